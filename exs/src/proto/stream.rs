//! SOCK_STREAM: the dynamic stream protocol of seed 001. (Being written: stream sockets are refused until then.)

use std::sync::Arc;

use exs_dma::DmaBuf;

use crate::error::{OpError, Violation};
use crate::event::Ticket;
use crate::options::{MsgFlags, SocketOptions};
use crate::proto::conn::Limits;
use crate::proto::link::Link;
use crate::transport::{Exposure, Registration, Sge, Transport, TransportError, WcError};
use crate::wire::{CloseReason, Handshake, StreamAdvert};

/// Counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StreamStats {}

/// Our intermediate stream buffer, exposed for the peer to write.
#[derive(Debug)]
pub(crate) struct StreamSetup {
    pub buf: Arc<DmaBuf>,
    pub reg: Arc<dyn Registration>,
    pub exposure: Box<dyn Exposure>,
    pub len: usize,
}

impl StreamSetup {
    pub(crate) fn new(_t: &mut dyn Transport, _len: usize) -> Result<Self, TransportError> {
        Err(TransportError::Unsupported("stream sockets".into()))
    }
}

#[derive(Debug)]
pub(crate) struct StreamProto {}

impl StreamProto {
    pub(crate) fn new(_s: &StreamSetup, _p: &Handshake, _o: &SocketOptions, _l: Limits) -> Result<Self, Violation> {
        Err(Violation::Handshake("stream sockets are not available".into()))
    }
    pub(crate) fn stats(&self) -> StreamStats {
        StreamStats {}
    }
    pub(crate) fn pump(&mut self, _link: &mut Link) {}
    pub(crate) fn send(&mut self, _t: Ticket, _s: Sge, _f: MsgFlags) {}
    pub(crate) fn recv(&mut self, _t: Ticket, _e: Box<dyn Exposure>, _r: Arc<dyn Registration>, _f: MsgFlags) {}
    pub(crate) fn on_write_imm(&mut self, _imm: u32, _l: &mut Link) -> Result<(), Violation> {
        Ok(())
    }
    pub(crate) fn on_write_done(&mut self, _tag: u32, _s: Result<(), WcError>) {}
    pub(crate) fn on_advert(&mut self, _a: StreamAdvert, _l: &mut Link) -> Result<(), Violation> {
        Ok(())
    }
    pub(crate) fn on_window(&mut self, _c: u64) -> Result<(), Violation> {
        Ok(())
    }
    pub(crate) fn on_peer_close(&mut self, _r: CloseReason) {}
    pub(crate) fn fail(&mut self, _e: OpError) {}
    pub(crate) fn drop_all(&mut self, _e: OpError) {}
}
