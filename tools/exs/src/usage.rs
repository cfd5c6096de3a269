//! What a side of a measurement cost: CPU seconds and context switches (`getrusage`), and the progress thread's
//! wake-ups (the context's own counter). Differences of two snapshots are reported per message.

use nix::sys::resource::{getrusage, UsageWho};

/// One snapshot (or a difference of two).
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Usage {
    /// User + system CPU seconds.
    pub cpu: f64,
    /// Voluntary context switches (the thread went to sleep).
    pub vcsw: u64,
    /// Involuntary context switches (the thread was preempted).
    pub ivcsw: u64,
    /// Wake-ups of the context's progress thread.
    pub wakeups: u64,
    /// Work requests the context posted (sends, receives, reads, writes).
    pub posted: u64,
    /// Memory registrations the context made (pinning on hardware: none belong on the data path).
    pub registrations: u64,
    /// Remote keys the context handed out (window binds, or per-connection key entries).
    pub exposures: u64,
}

impl Usage {
    /// Now, for this whole process (`whole`) or for the calling thread only (when both sides share a process,
    /// so neither counts the other's switches; the progress thread's are then its wake-ups).
    pub fn now(ctx: &exs::Context, whole: bool) -> Usage {
        let who = if whole {
            UsageWho::RUSAGE_SELF
        } else {
            UsageWho::RUSAGE_THREAD
        };
        let wakeups = ctx.progress_stats().thread_wakeups;
        let st = ctx.stats();
        let (posted, registrations, exposures) = (st.posted, st.registrations, st.exposures);
        match getrusage(who) {
            Ok(u) => {
                let t =
                    |tv: nix::sys::time::TimeVal| tv.tv_sec() as f64 + tv.tv_usec() as f64 / 1e6;
                Usage {
                    cpu: t(u.user_time()) + t(u.system_time()),
                    vcsw: u.voluntary_context_switches() as u64,
                    ivcsw: u.involuntary_context_switches() as u64,
                    wakeups,
                    posted,
                    registrations,
                    exposures,
                }
            }
            Err(_) => Usage {
                wakeups,
                posted,
                registrations,
                exposures,
                ..Usage::default()
            },
        }
    }

    /// What happened since `start`.
    pub fn since(self, start: Usage) -> Usage {
        Usage {
            cpu: self.cpu - start.cpu,
            vcsw: self.vcsw.saturating_sub(start.vcsw),
            ivcsw: self.ivcsw.saturating_sub(start.ivcsw),
            wakeups: self.wakeups.saturating_sub(start.wakeups),
            posted: self.posted.saturating_sub(start.posted),
            registrations: self.registrations.saturating_sub(start.registrations),
            exposures: self.exposures.saturating_sub(start.exposures),
        }
    }

    /// Context switches, counting the progress thread's wake-ups where the process total is not measured.
    pub fn switches(&self, whole: bool) -> u64 {
        // Saturating: a peer's figures come over the wire (a hostile server's made the sum overflow).
        let switches = self.vcsw.saturating_add(self.ivcsw);
        if whole {
            switches
        } else {
            switches.saturating_add(self.wakeups)
        }
    }

    /// Per-message figures as JSON fields with a prefix (`client_`, `server_`).
    pub fn per_msg_json(
        &self,
        prefix: &str,
        msgs: u64,
        map: &mut serde_json::Map<String, serde_json::Value>,
    ) {
        let n = msgs.max(1) as f64;
        map.insert(
            format!("{prefix}vcsw_per_msg"),
            (self.vcsw as f64 / n).into(),
        );
        map.insert(
            format!("{prefix}ivcsw_per_msg"),
            (self.ivcsw as f64 / n).into(),
        );
        map.insert(
            format!("{prefix}progress_wakeups_per_msg"),
            (self.wakeups as f64 / n).into(),
        );
        map.insert(
            format!("{prefix}posts_per_msg"),
            (self.posted as f64 / n).into(),
        );
        map.insert(
            format!("{prefix}exposures_per_msg"),
            (self.exposures as f64 / n).into(),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::Usage;

    /// Review: a hostile server's `done` with counts near `u64::MAX` made the client's sum of context switches
    /// overflow (a panic in a debug build, a wrong figure in a release one). The sums saturate.
    #[test]
    fn a_peers_huge_counts_do_not_overflow_the_sums() {
        let u = Usage {
            vcsw: u64::MAX,
            ivcsw: u64::MAX,
            wakeups: u64::MAX,
            ..Usage::default()
        };
        assert_eq!(u.switches(true), u64::MAX);
        assert_eq!(u.switches(false), u64::MAX);
    }
}
