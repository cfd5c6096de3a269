//! Tests of the engine's calls: the numbering of sockets and endpoints.

use std::time::Duration;

use super::LAST_SOCKET_ID;
use crate::sim::{SimConfig, World};
use crate::{Context, EventQueue, SockType, Socket, SocketId};

/// A manual world of two hosts, a SOCK_SEQPACKET listener on the second at `port`, and a queue: (world, the
/// first host's context, the listener, the queue).
fn listening(port: u16) -> (World, Context, Socket, EventQueue) {
    let world = World::new(SimConfig::default());
    let (a, b) = (world.host(), world.host());
    let l = Socket::new(&b, SockType::SeqPacket).unwrap();
    l.bind(world.addr(1, port)).unwrap();
    l.listen(4).unwrap();
    (world, a, l, EventQueue::new(8).unwrap())
}

/// Regression (review): endpoint numbers wrapped without looking at the endpoints still held, so after 2^32
/// of them a new connection could take a live one's number and its completions.
#[test]
fn endpoint_numbers_skip_the_endpoints_still_held() {
    let (world, a, _listener, eq) = listening(6000);
    let connect = || {
        let c = Socket::new(&a, SockType::SeqPacket).unwrap();
        c.connect(&eq, world.addr(1, 6000), 1).unwrap();
        world.run_until_idle(100_000);
        let ev = eq.next(None).unwrap();
        assert!(ev.is_ok(), "{ev:?}");
        let ep = a.shared().lock().sockets[&c.id()].ep().unwrap();
        (c, ep)
    };
    let (first, ep1) = connect();
    // The count comes round to the first connection's number.
    a.shared().lock().set_next_ep(ep1.0);
    let (second, ep2) = connect();
    assert_ne!(ep1, ep2, "a live endpoint's number given again");
    let e = a.shared().lock();
    assert_eq!((e.eps[&ep1], e.eps[&ep2]), (first.id(), second.id()));
}

#[test]
fn socket_numbers_wrap_at_their_last_and_skip_the_sockets_still_held() {
    let world = World::new(SimConfig::default());
    let ctx = world.host();
    let new = || Socket::new(&ctx, SockType::Stream).unwrap();
    let (one, two) = (new(), new());
    assert_eq!((one.id(), two.id()), (SocketId(1), SocketId(2)));
    ctx.shared().lock().set_next_socket_id(LAST_SOCKET_ID);
    let last = new();
    assert_eq!(
        last.id(),
        SocketId((1 << 29) - 1),
        "the highest socket number, below the C API's queue and memory handles"
    );
    let after = new();
    assert_eq!(
        after.id(),
        SocketId(3),
        "round again, past the sockets still open"
    );
    // A closed socket's number is free again; the open ones' are not.
    one.close().unwrap();
    ctx.shared().lock().set_next_socket_id(1);
    let again = new();
    assert_eq!(again.id(), SocketId(1));
    assert_eq!(new().id(), SocketId(4));
    // Each number names one socket: binding the new socket 1 leaves socket 2 unbound.
    again.bind(world.addr(0, 5000)).unwrap();
    two.bind(world.addr(0, 5001)).unwrap();
}

/// Regression (review): the handshake time was read back from the connect timer's deadline less the context's
/// connect timeout, so a connect with a timeout of its own (1 s against the context's 10 s) reported 9 s more
/// than it took. It is measured from when the handshake began.
#[test]
fn a_connect_with_its_own_timeout_reports_the_handshake_it_took() {
    let (world, a, _listener, eq) = listening(6001);
    let c = Socket::new(&a, SockType::SeqPacket).unwrap();
    c.connect_within(&eq, world.addr(1, 6001), Some(Duration::from_secs(1)), 1)
        .unwrap();
    world.run_until_idle(100_000);
    assert!(eq.next(None).unwrap().is_ok());
    let took = c.stats().unwrap().handshake.expect("a handshake time");
    assert!(took < Duration::from_millis(100), "{took:?}");
}

/// A review found it: a sendfile that gave up reset whatever socket had its number by then, though the hold it
/// released was another connection's (the sendfile's socket gone, its number taken again).
#[test]
fn a_sendfile_giving_up_leaves_a_socket_that_took_its_number_alone() {
    let world = World::new(SimConfig::default());
    let (a, b) = (world.host(), world.host());
    let l = Socket::new(&b, SockType::Stream).unwrap();
    l.bind(world.addr(1, 6003)).unwrap();
    l.listen(4).unwrap();
    let eq = EventQueue::new(8).unwrap();
    let connect = || {
        let c = Socket::new(&a, SockType::Stream).unwrap();
        c.connect(&eq, world.addr(1, 6003), 1).unwrap();
        world.run_until_idle(100_000);
        let ev = eq.next(None).unwrap();
        assert!(ev.is_ok(), "{ev:?}");
        c
    };
    let first = connect();
    let number = first.id();
    let hold = a.shared().lock().hold_sends(number).unwrap();
    first.abort().unwrap();
    world.run_until_idle(100_000);
    assert!(
        !a.shared().lock().sockets.contains_key(&number),
        "the sendfile's socket is gone"
    );
    a.shared().lock().set_next_socket_id(number.0);
    let second = connect();
    assert_eq!(second.id(), number, "the number is taken again");
    a.shared().lock().release_sends(number, hold, true);
    world.run_until_idle(100_000);
    assert_eq!(
        second.error().unwrap(),
        None,
        "the socket that took the number is not reset"
    );
}
