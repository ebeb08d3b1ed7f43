//! What the soak watches: the agent process (`/proc/PID`) and its Prometheus `/metrics`.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use anyhow::{Context, Result, bail};

use crate::netns::Netns;

/// `VmRSS` of `pid`, KiB.
pub fn rss_kib(pid: u32) -> Result<u64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let line = text
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .context("no VmRSS")?;
    Ok(line
        .split_whitespace()
        .nth(1)
        .context("bad VmRSS line")?
        .parse()?)
}

/// Open file descriptors of `pid` (entries of `/proc/PID/fd`).
pub fn fd_count(pid: u32) -> Result<usize> {
    Ok(std::fs::read_dir(format!("/proc/{pid}/fd"))?.count())
}

/// Threads of `pid`.
pub fn threads(pid: u32) -> Result<usize> {
    Ok(std::fs::read_dir(format!("/proc/{pid}/task"))?.count())
}

/// utime + stime of all threads of `pid`, seconds.
pub fn cpu_seconds(pid: u32) -> Result<f64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    let rest = text
        .rsplit_once(')')
        .map(|(_, r)| r)
        .context("bad /proc stat")?;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // After the command: state is index 0, utime (field 14 overall) index 11, stime 12.
    let utime: u64 = fields.get(11).context("no utime")?.parse()?;
    let stime: u64 = fields.get(12).context("no stime")?.parse()?;
    // SAFETY: sysconf has no memory effects.
    let tck = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    Ok((utime + stime) as f64 / tck)
}

/// `GET /metrics` from `addr` inside `ns`.
pub fn scrape(ns: &Netns, addr: SocketAddr) -> Result<Metrics> {
    let body = ns.run_in(|| {
        let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(5))
            .with_context(|| format!("connecting to {addr}"))?;
        s.set_read_timeout(Some(Duration::from_secs(20)))?;
        write!(
            s,
            "GET /metrics HTTP/1.0\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
        )?;
        let mut raw = Vec::new();
        s.read_to_end(&mut raw)?;
        let text = String::from_utf8_lossy(&raw).into_owned();
        let Some((head, body)) = text.split_once("\r\n\r\n") else {
            bail!("no HTTP response from {addr}");
        };
        if !head.starts_with("HTTP/1.") || !head.contains(" 200 ") {
            bail!("{addr}/metrics: {}", head.lines().next().unwrap_or(""));
        }
        Ok(body.to_string())
    })?;
    Ok(Metrics::parse(&body))
}

/// One sample of a Prometheus text exposition.
#[derive(Clone, Debug)]
struct Series {
    name: String,
    labels: String,
    value: f64,
}

/// A parsed `/metrics` scrape.
#[derive(Clone, Debug, Default)]
pub struct Metrics {
    series: Vec<Series>,
}

impl Metrics {
    pub fn parse(text: &str) -> Metrics {
        let series = text
            .lines()
            .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
            .filter_map(|l| {
                let (key, value) = match l.find('}') {
                    Some(end) => (&l[..=end], l[end + 1..].split_whitespace().next()?),
                    None => l.split_once(' ')?,
                };
                let (name, labels) = match key.split_once('{') {
                    Some((n, rest)) => (n, rest.trim_end_matches('}')),
                    None => (key, ""),
                };
                Some(Series {
                    name: name.to_string(),
                    labels: labels.to_string(),
                    value: value.trim().parse().ok()?,
                })
            })
            .collect();
        Metrics { series }
    }

    /// The sum of `name` over the label sets that contain every `label="value"` of `with`.
    pub fn sum(&self, name: &str, with: &[&str]) -> f64 {
        self.series
            .iter()
            .filter(|s| s.name == name && with.iter().all(|w| s.labels.contains(w)))
            .map(|s| s.value)
            .sum::<f64>()
            + 0.0 // An empty sum is -0.0.
    }

    /// Whether any series of `name` exists.
    pub fn has(&self, name: &str) -> bool {
        self.series.iter().any(|s| s.name == name)
    }

    /// The cumulative buckets of histogram `name` (`_bucket`), summed over its label sets:
    /// (upper bound, count), ascending.
    pub fn buckets(&self, name: &str) -> Vec<(f64, f64)> {
        let bucket = format!("{name}_bucket");
        let mut by_le: Vec<(f64, f64)> = Vec::new();
        for s in self.series.iter().filter(|s| s.name == bucket) {
            let Some(le) = s
                .labels
                .split(',')
                .find_map(|kv| kv.trim().strip_prefix("le=\""))
                .map(|v| v.trim_end_matches('"'))
            else {
                continue;
            };
            let le: f64 = if le == "+Inf" {
                f64::INFINITY
            } else {
                match le.parse() {
                    Ok(v) => v,
                    Err(_) => continue,
                }
            };
            match by_le.iter_mut().find(|(b, _)| *b == le) {
                Some(entry) => entry.1 += s.value,
                None => by_le.push((le, s.value)),
            }
        }
        by_le.sort_by(|a, b| a.0.total_cmp(&b.0));
        by_le
    }
}

/// Histogram `name` between two scrapes: count, sum and the bucket counts.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct HistogramIncrease {
    pub count: f64,
    pub sum_seconds: f64,
    pub mean_ms: Option<f64>,
    /// Estimated as Prometheus' `histogram_quantile` does (linear within the bucket), ms.
    pub p50_ms: Option<f64>,
    pub p99_ms: Option<f64>,
    pub max_bucket_ms: Option<f64>,
}

impl HistogramIncrease {
    pub fn between(before: &Metrics, after: &Metrics, name: &str) -> HistogramIncrease {
        let count =
            after.sum(&format!("{name}_count"), &[]) - before.sum(&format!("{name}_count"), &[]);
        let sum = after.sum(&format!("{name}_sum"), &[]) - before.sum(&format!("{name}_sum"), &[]);
        let b0 = before.buckets(name);
        let buckets: Vec<(f64, f64)> = after
            .buckets(name)
            .into_iter()
            .map(|(le, n)| {
                let was = b0.iter().find(|(l, _)| *l == le).map_or(0.0, |(_, c)| *c);
                (le, n - was)
            })
            .collect();
        let quantile = |q: f64| quantile(&buckets, q).map(|s| s * 1e3);
        // The upper bound of the highest bucket that gained anything.
        let mut max_bucket = None;
        let mut below = 0.0;
        for &(le, n) in &buckets {
            if n > below {
                max_bucket = Some(le * 1e3);
            }
            below = n;
        }
        HistogramIncrease {
            count,
            sum_seconds: sum,
            mean_ms: (count > 0.0).then(|| sum / count * 1e3),
            p50_ms: quantile(0.5),
            p99_ms: quantile(0.99),
            max_bucket_ms: max_bucket,
        }
    }
}

/// `histogram_quantile(q, buckets)` over cumulative (upper bound, count) buckets.
fn quantile(buckets: &[(f64, f64)], q: f64) -> Option<f64> {
    let total = buckets.last()?.1;
    if total <= 0.0 {
        return None;
    }
    let rank = q * total;
    let mut prev = (0.0, 0.0);
    for &(le, n) in buckets {
        if n >= rank {
            if le.is_infinite() {
                return Some(prev.0);
            }
            let width = n - prev.1;
            let frac = if width > 0.0 {
                (rank - prev.1) / width
            } else {
                1.0
            };
            return Some(prev.0 + (le - prev.0) * frac);
        }
        prev = (le, n);
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT: &str = "# HELP x_seconds A histogram.
# TYPE x_seconds histogram
x_seconds_bucket{ip_family=\"IPv4\",le=\"0.5\"} 2
x_seconds_bucket{ip_family=\"IPv4\",le=\"1\"} 4
x_seconds_bucket{ip_family=\"IPv4\",le=\"+Inf\"} 4
x_seconds_sum{ip_family=\"IPv4\"} 2.5
x_seconds_count{ip_family=\"IPv4\"} 4
x_seconds_bucket{ip_family=\"IPv6\",le=\"0.5\"} 0
x_seconds_bucket{ip_family=\"IPv6\",le=\"1\"} 0
x_seconds_bucket{ip_family=\"IPv6\",le=\"+Inf\"} 0
x_seconds_sum{ip_family=\"IPv6\"} 0
x_seconds_count{ip_family=\"IPv6\"} 0
plain_total 7
";

    #[test]
    fn parses_and_sums() {
        let m = Metrics::parse(TEXT);
        assert_eq!(m.sum("plain_total", &[]), 7.0);
        assert_eq!(m.sum("x_seconds_count", &["ip_family=\"IPv4\""]), 4.0);
        assert_eq!(
            m.buckets("x_seconds"),
            vec![(0.5, 2.0), (1.0, 4.0), (f64::INFINITY, 4.0)]
        );
        let d = HistogramIncrease::between(&Metrics::default(), &m, "x_seconds");
        assert_eq!(d.count, 4.0);
        assert_eq!(d.mean_ms, Some(625.0));
        assert_eq!(d.p50_ms, Some(500.0));
        assert_eq!(d.max_bucket_ms, Some(1000.0));
    }
}
