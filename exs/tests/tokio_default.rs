//! The tokio forms on the process's default context, in a process of their own: the context is not open when the
//! test starts (other tests of the same binary would have opened it).

#![cfg(feature = "tokio")]

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// Issue 26 (no blocking inside an `async fn`): the first `exs::tokio::Listener::bind` opens the default context
/// on tokio's blocking pool, so the runtime's one thread runs other tasks meanwhile; before, the opening (libfabric's
/// start among it) ran on the task's own thread and held the runtime.
#[test]
fn the_first_bind_opens_the_default_context_off_the_runtimes_thread() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .build()
        .expect("a runtime");
    rt.block_on(async {
        let ran = Arc::new(AtomicBool::new(false));
        let other = {
            let ran = Arc::clone(&ran);
            tokio::spawn(async move { ran.store(true, Ordering::SeqCst) })
        };
        // Nothing in bind below yields to the runtime but the opening of the context.
        let listener = exs::tokio::Listener::bind("0.0.0.0:0")
            .await
            .expect("bind on the default context");
        assert!(
            ran.load(Ordering::SeqCst),
            "the other task never ran while the default context opened: it opened on the runtime's thread"
        );
        other.await.expect("the other task");
        drop(listener);
        // Open now: later calls take it as it is.
        let again = exs::tokio::Listener::bind("0.0.0.0:0").await.expect("bind");
        drop(again);
    });
}
