//! The baselines' helper servers (`exs rawpump|rawping|tcppump|tcpping --serve`, each started by the client side of
//! the same command): their client is named by a token, as a test's data connection is ([`crate::admit`]), so that
//! whoever connects to a helper's listener first does not take the client's place in the measurement (and hold the
//! helper meanwhile). The token reaches the helper in its environment ([`TOKEN_VAR`]: readable by its own user only,
//! unlike its command line) and comes back first on the client's connection: its first eight bytes on TCP
//! ([`crate::tcp_admit`]), the connection request's private data on a raw transport ([`accept_request`]).

use std::process::Command;
use std::time::Instant;

use anyhow::{anyhow, bail, Context as _, Result};
use exs::transport::{CmEvent, RequestId, Transport};

use crate::tcp_admit::Refused;
use crate::util::PATIENCE;

/// The variable that hands a helper its token.
pub(crate) const TOKEN_VAR: &str = "EXS_HELPER_TOKEN";

/// A new token for the helper `cmd` is about to start, set in its environment.
pub(crate) fn give(cmd: &mut Command) -> Result<u64> {
    let token = crate::control::new_token()?;
    cmd.env(TOKEN_VAR, token.to_string());
    Ok(token)
}

/// The token this helper was started with.
pub(crate) fn token() -> Result<u64> {
    let v = std::env::var(TOKEN_VAR).map_err(|_| {
        anyhow!("--serve is internal: its client starts it, with a token in {TOKEN_VAR}")
    })?;
    v.parse()
        .with_context(|| format!("{TOKEN_VAR}: not a token: {v:?}"))
}

/// The private data a raw client connects with: the token.
pub(crate) fn private(token: u64) -> [u8; 8] {
    token.to_le_bytes()
}

/// Waits, at most [`PATIENCE`], for the connection request whose private data begins with `token` (a transport may
/// pad private data), refusing every other one; returns it.
pub(crate) fn accept_request(t: &mut dyn Transport, token: u64) -> Result<RequestId> {
    let deadline = Instant::now() + PATIENCE;
    let mut refused = Refused::new("helper's listener");
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            bail!(
                "no connection request with this helper's token within {} s",
                PATIENCE.as_secs()
            );
        }
        let Ok(ev) = crate::baseline::next_cm_within(t, left) else {
            continue;
        };
        if let CmEvent::ConnectRequest {
            request,
            peer,
            private: got,
            ..
        } = ev
        {
            if got.get(..8) == Some(&private(token)[..]) {
                return Ok(request);
            }
            t.reject(request);
            refused.close(peer, &anyhow!("not its client's token"));
        }
    }
}

#[cfg(all(test, feature = "sim"))]
mod tests {
    use super::*;
    use exs::sim::{SimConfig, World};
    use exs::transport::EndpointId;

    /// Strangers' requests that come first (no private data, another token) are refused, and the client's,
    /// behind them, is the one taken (a helper used to accept the first request, whoever sent it).
    #[test]
    fn a_raw_helper_refuses_strangers_and_takes_its_client() {
        let world = World::threaded(SimConfig::default());
        let mut helper = world.raw_host();
        let (_, addr) = helper.listen(world.addr(0, 7471), 8).unwrap();
        let token = 0x5eed_0f7e_57a1_u64;
        let mut peers = [world.raw_host(), world.raw_host(), world.raw_host()];
        let privates = [
            Vec::new(),
            private(token ^ 1).to_vec(),
            private(token).to_vec(),
        ];
        for (t, p) in peers.iter_mut().zip(&privates) {
            t.connect(EndpointId(1), addr, p, Vec::new()).unwrap();
        }
        let request = accept_request(&mut helper, token).expect("the client's request");
        helper
            .accept(request, EndpointId(1), &[], Vec::new())
            .unwrap();
        let [stranger, other, client] = peers
            .each_mut()
            .map(|t| crate::baseline::next_cm_within(t, std::time::Duration::from_secs(10)).ok());
        assert!(
            matches!(stranger, Some(CmEvent::ConnectFailed { .. })),
            "a stranger without a token: {stranger:?}"
        );
        assert!(
            matches!(other, Some(CmEvent::ConnectFailed { .. })),
            "a stranger with another token: {other:?}"
        );
        assert!(
            matches!(client, Some(CmEvent::Established { .. })),
            "the client: {client:?}"
        );
    }
}
