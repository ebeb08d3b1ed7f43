//! Where a cold start's time went, seen from outside the agent: when its log lines for the
//! completed lists and the commits arrived, and the CPU time of its threads by kind (the tokio
//! workers list, decode and convert; the other threads are the sync loop's: build, plan,
//! encode in user time, nf_tables' commit in system time).

use std::time::Instant;

use anyhow::{Context, Result};

/// One cold start's timeline, seconds since exec.
#[derive(Clone, Copy, Debug, Default)]
pub struct Timeline {
    /// The first of the two lists began (its log line says how long it took).
    pub listing: f64,
    /// Both Services and EndpointSlices listed.
    pub listed: f64,
    /// The first family's commit logged.
    pub first_commit: f64,
    /// CPU seconds (user, system) of the tokio workers.
    pub workers: (f64, f64),
    /// CPU seconds (user, system) of the other threads.
    pub others: (f64, f64),
}

impl Timeline {
    /// From the agent's timed log lines (`marks`) and its threads now.
    pub fn of(pid: u32, started: Instant, marks: &[(Instant, String)]) -> Result<Timeline> {
        let since = |t: &Instant| t.saturating_duration_since(started).as_secs_f64();
        // When each list ended, and when it began (the line gives its duration in seconds).
        let listed_at = |kind: &str| {
            let (quoted, bare) = (format!("kind=\"{kind}\""), format!("kind={kind} "));
            marks
                .iter()
                .find(|(_, l)| l.contains(" listed ") && (l.contains(&quoted) || l.contains(&bare)))
                .map(|(t, l)| (since(t), since(t) - field(l, "seconds").unwrap_or(0.0)))
        };
        let ((s_end, s_start), (e_end, e_start)) = listed_at("Service")
            .zip(listed_at("EndpointSlice"))
            .context("the agent did not log both lists")?;
        let (listed, listing) = (s_end.max(e_end), s_start.min(e_start));
        let first_commit = marks
            .iter()
            .find(|(_, l)| l.contains("nftables sync committed"))
            .map(|(t, _)| since(t))
            .context("the agent logged no commit")?;
        let (mut workers, mut others) = ((0.0, 0.0), (0.0, 0.0));
        for (name, user, system) in thread_cpu(pid)? {
            let into = if name.starts_with("tokio") {
                &mut workers
            } else {
                &mut others
            };
            into.0 += user;
            into.1 += system;
        }
        Ok(Timeline {
            listing,
            listed,
            first_commit,
            workers,
            others,
        })
    }

    /// The medians of each figure.
    pub fn median(all: &[Timeline]) -> Timeline {
        let m = |f: fn(&Timeline) -> f64| crate::median(all.iter().map(f).collect());
        Timeline {
            listing: m(|t| t.listing),
            listed: m(|t| t.listed),
            first_commit: m(|t| t.first_commit),
            workers: (m(|t| t.workers.0), m(|t| t.workers.1)),
            others: (m(|t| t.others.0), m(|t| t.others.1)),
        }
    }

    pub fn describe(&self, floor: f64) -> String {
        format!(
            "lists begun {:.2} s after exec, done {:.2} s ({:.2}× the floor), first commit +{:.2} s; CPU s user/system: \
             tokio workers {:.2}/{:.2}, sync and other threads {:.2}/{:.2}",
            self.listing,
            self.listed,
            self.listed / floor,
            self.first_commit - self.listed,
            self.workers.0,
            self.workers.1,
            self.others.0,
            self.others.1
        )
    }
}

/// The number in `name=value` of a log line.
fn field(line: &str, name: &str) -> Option<f64> {
    let at = line.find(&format!("{name}="))? + name.len() + 1;
    let value = line[at..]
        .split(|c: char| c.is_whitespace() || c == ',')
        .next()?;
    value.trim_matches('"').parse().ok()
}

/// Each thread of `pid`: its name and CPU seconds in user and system mode.
fn thread_cpu(pid: u32) -> Result<Vec<(String, f64, f64)>> {
    // SAFETY: sysconf has no memory effects.
    let tck = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    let mut out = Vec::new();
    for entry in std::fs::read_dir(format!("/proc/{pid}/task"))? {
        let Ok(text) = std::fs::read_to_string(entry?.path().join("stat")) else {
            continue; // The thread ended meanwhile.
        };
        let (head, rest) = text.rsplit_once(')').context("bad /proc stat")?;
        let name = head.split_once('(').map_or("", |(_, n)| n).to_string();
        let fields: Vec<&str> = rest.split_whitespace().collect();
        // After the command: state is index 0, utime (field 14 overall) index 11, stime 12.
        let utime: u64 = fields.get(11).context("no utime")?.parse()?;
        let stime: u64 = fields.get(12).context("no stime")?.parse()?;
        out.push((name, utime as f64 / tck, stime as f64 / tck));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::field;

    #[test]
    fn fields_are_read_from_log_lines() {
        let line = "2026-12-04T17:00:00Z  INFO nftproxy::watch: listed kind=\"Service\" objects=30000 seconds=1.25";
        assert_eq!(field(line, "seconds"), Some(1.25));
        assert_eq!(field(line, "objects"), Some(30000.0));
        assert_eq!(field(line, "absent"), None);
    }
}
