//! The `process_*` metrics, as Go's client_golang process collector exports them on Linux
//! (what every Go component, kube-proxy included, has on its `/metrics`): same names, help
//! texts, types and units, read from `/proc/self` at every scrape.
//!
//! The `prometheus` crate's own `process` feature is not used: it truncates CPU seconds and the
//! start time to whole seconds, adds `process_threads` (not a client_golang metric), lacks
//! `process_virtual_memory_max_bytes` and the network counters, and pulls in `procfs`.
//!
//! As in client_golang (with `ReportErrors` off, how component-base registers it), a value that
//! cannot be read is left out of the scrape; the others are still exported.

use std::collections::HashMap;

use prometheus::core::{Collector, Desc};
use prometheus::proto::{Counter, Gauge, Metric, MetricFamily, MetricType};

/// Clock ticks per second of `/proc/<pid>/stat` times. client_golang (through the `procfs`
/// package) uses the constant 100, the value of `USER_HZ` on every Linux architecture.
const USER_HZ: f64 = 100.0;

/// (name, help, type) of each family, in client_golang's words.
const FAMILIES: [(&str, &str, MetricType); 9] = [
    (
        "process_cpu_seconds_total",
        "Total user and system CPU time spent in seconds.",
        MetricType::COUNTER,
    ),
    (
        "process_open_fds",
        "Number of open file descriptors.",
        MetricType::GAUGE,
    ),
    (
        "process_max_fds",
        "Maximum number of open file descriptors.",
        MetricType::GAUGE,
    ),
    (
        "process_virtual_memory_bytes",
        "Virtual memory size in bytes.",
        MetricType::GAUGE,
    ),
    (
        "process_virtual_memory_max_bytes",
        "Maximum amount of virtual memory available in bytes.",
        MetricType::GAUGE,
    ),
    (
        "process_resident_memory_bytes",
        "Resident memory size in bytes.",
        MetricType::GAUGE,
    ),
    (
        "process_start_time_seconds",
        "Start time of the process since unix epoch in seconds.",
        MetricType::GAUGE,
    ),
    (
        "process_network_receive_bytes_total",
        "Number of bytes received by the process over the network.",
        MetricType::COUNTER,
    ),
    (
        "process_network_transmit_bytes_total",
        "Number of bytes sent by the process over the network.",
        MetricType::COUNTER,
    ),
];

/// The fields of `/proc/<pid>/stat` the collector uses.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Stat {
    /// User and system time, in clock ticks.
    pub utime: u64,
    pub stime: u64,
    /// Start time after boot, in clock ticks.
    pub starttime: u64,
    /// Virtual memory size in bytes.
    pub vsize: u64,
    /// Resident set size in pages.
    pub rss: u64,
}

/// Parses `/proc/<pid>/stat`. The command name (field 2) is in parentheses and may itself hold
/// spaces and parentheses, so the fields are counted after its last `)`.
pub fn parse_stat(text: &str) -> Option<Stat> {
    let (_, rest) = text.rsplit_once(')')?;
    // rest[0] is field 3 (state): field N is rest[N - 3].
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let field = |n: usize| -> Option<u64> { fields.get(n - 3)?.parse().ok() };
    Some(Stat {
        utime: field(14)?,
        stime: field(15)?,
        starttime: field(22)?,
        vsize: field(23)?,
        rss: field(24)?,
    })
}

/// The soft limit of `name` (e.g. `Max open files`) in `/proc/<pid>/limits`; `unlimited` is
/// the largest `u64`, as the `procfs` package reports it.
pub fn parse_limit(text: &str, name: &str) -> Option<f64> {
    // The limit's name is followed by the padding of its column: at least two spaces.
    let rest = text
        .lines()
        .find_map(|l| l.strip_prefix(name).filter(|r| r.starts_with("  ")))?;
    let soft = rest.split_whitespace().next()?;
    if soft == "unlimited" {
        return Some(u64::MAX as f64);
    }
    soft.parse::<u64>().ok().map(|v| v as f64)
}

/// `btime` (boot time, seconds since the epoch) from `/proc/stat`.
pub fn parse_boot_time(text: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix("btime "))
        .and_then(|v| v.trim().parse::<u64>().ok())
        .map(|v| v as f64)
}

/// `IpExt: InOctets` and `OutOctets` from `/proc/<pid>/net/netstat` (a header line of names and
/// a line of values per section). A missing field counts as 0, as in client_golang.
pub fn parse_netstat_octets(text: &str) -> Option<(f64, f64)> {
    let mut lines = text
        .lines()
        .filter_map(|l| l.strip_prefix("IpExt:"))
        .map(|l| l.split_whitespace().collect::<Vec<_>>());
    let names = lines.next()?;
    let values = lines.next()?;
    let section: HashMap<&str, &str> = names.into_iter().zip(values).collect();
    let get = |k: &str| -> f64 {
        section
            .get(k)
            .and_then(|v| v.parse::<u64>().ok())
            .map_or(0.0, |v| v as f64)
    };
    Some((get("InOctets"), get("OutOctets")))
}

/// The collector for the calling process.
#[derive(Debug)]
pub struct ProcessCollector {
    descs: Vec<Desc>,
    page_size: f64,
}

impl ProcessCollector {
    pub fn new() -> ProcessCollector {
        let descs = FAMILIES
            .iter()
            .map(|(name, help, _)| {
                Desc::new(
                    name.to_string(),
                    help.to_string(),
                    Vec::new(),
                    HashMap::new(),
                )
                .expect("valid process metric description")
            })
            .collect();
        ProcessCollector {
            descs,
            page_size: page_size(),
        }
    }

    /// The current values, `(family index, value)`, of whatever could be read.
    fn values(&self) -> Vec<(usize, f64)> {
        let read = |path: &str| std::fs::read_to_string(path).ok();
        let mut out = Vec::with_capacity(FAMILIES.len());
        if let Some(stat) = read("/proc/self/stat").as_deref().and_then(parse_stat) {
            out.push((0, (stat.utime + stat.stime) as f64 / USER_HZ));
            out.push((3, stat.vsize as f64));
            out.push((5, stat.rss as f64 * self.page_size));
            if let Some(boot) = read("/proc/stat").as_deref().and_then(parse_boot_time) {
                out.push((6, boot + stat.starttime as f64 / USER_HZ));
            }
        }
        if let Ok(dir) = std::fs::read_dir("/proc/self/fd") {
            out.push((1, dir.count() as f64));
        }
        if let Some(limits) = read("/proc/self/limits") {
            if let Some(v) = parse_limit(&limits, "Max open files") {
                out.push((2, v));
            }
            if let Some(v) = parse_limit(&limits, "Max address space") {
                out.push((4, v));
            }
        }
        if let Some((rx, tx)) = read("/proc/self/net/netstat")
            .as_deref()
            .and_then(parse_netstat_octets)
        {
            out.push((7, rx));
            out.push((8, tx));
        }
        out.sort_by_key(|(i, _)| *i);
        out
    }
}

impl Default for ProcessCollector {
    fn default() -> ProcessCollector {
        ProcessCollector::new()
    }
}

impl Collector for ProcessCollector {
    fn desc(&self) -> Vec<&Desc> {
        self.descs.iter().collect()
    }

    fn collect(&self) -> Vec<MetricFamily> {
        self.values()
            .into_iter()
            .map(|(i, value)| {
                let (name, help, kind) = FAMILIES[i];
                let mut metric = Metric::default();
                if kind == MetricType::COUNTER {
                    let mut c = Counter::default();
                    c.set_value(value);
                    metric.set_counter(c);
                } else {
                    let mut g = Gauge::default();
                    g.set_value(value);
                    metric.set_gauge(g);
                }
                let mut family = MetricFamily::default();
                family.set_name(name.to_string());
                family.set_help(help.to_string());
                family.set_field_type(kind);
                family.set_metric(vec![metric]);
                family
            })
            .collect()
    }
}

/// The page size (`rss` is in pages), as Go's `os.Getpagesize`.
fn page_size() -> f64 {
    // SAFETY: sysconf takes no pointers and only reads a configuration value.
    let size = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if size > 0 { size as f64 } else { 4096.0 }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_fields_are_counted_after_the_command_name() {
        // A command name with spaces and parentheses; values from a real process.
        let text = "4242 (my (odd) proc) S 1 4242 4242 0 -1 4194560 1700 0 3 0 \
                    123 45 0 0 20 0 9 0 987654 1234567168 2500 18446744073709551615 \
                    1 1 0 0 0 0 0 4096 17920 0 0 0 17 3 0 0 0 0 0\n";
        assert_eq!(
            parse_stat(text),
            Some(Stat {
                utime: 123,
                stime: 45,
                starttime: 987654,
                vsize: 1234567168,
                rss: 2500,
            })
        );
        assert_eq!(parse_stat("4242 (truncated) S 1 2"), None);
    }

    #[test]
    fn limits_read_the_soft_limit() {
        let text = "\
Limit                     Soft Limit           Hard Limit           Units     
Max cpu time              unlimited            unlimited            seconds   
Max open files            1024                 524288               files     
Max address space         unlimited            unlimited            bytes     
";
        assert_eq!(parse_limit(text, "Max open files"), Some(1024.0));
        assert_eq!(
            parse_limit(text, "Max address space"),
            Some(18446744073709551615.0)
        );
        assert_eq!(parse_limit(text, "Max open"), None);
        // client_golang prints the unlimited value like this.
        assert_eq!(
            crate::text::go_float(parse_limit(text, "Max cpu time").unwrap()),
            "1.8446744073709552e+19"
        );
    }

    #[test]
    fn boot_time_and_network_octets() {
        assert_eq!(
            parse_boot_time("cpu  1 2 3\nbtime 1733400000\nprocesses 9\n"),
            Some(1733400000.0)
        );
        let netstat = "\
TcpExt: SyncookiesSent SyncookiesRecv
TcpExt: 0 0
IpExt: InNoRoutes InOctets OutOctets InMcastOctets
IpExt: 0 89055479 239429 0
";
        assert_eq!(parse_netstat_octets(netstat), Some((89055479.0, 239429.0)));
        assert_eq!(
            parse_netstat_octets("IpExt: InNoRoutes\nIpExt: 0\n"),
            Some((0.0, 0.0))
        );
    }

    #[test]
    fn collects_every_family_of_this_process() {
        let c = ProcessCollector::new();
        let families = c.collect();
        let names: Vec<&str> = families.iter().map(|f| f.name()).collect();
        let want: Vec<&str> = FAMILIES.iter().map(|f| f.0).collect();
        assert_eq!(names, want);
        let value = |name: &str| {
            let f = families.iter().find(|f| f.name() == name).unwrap();
            let m = &f.get_metric()[0];
            match f.get_field_type() {
                MetricType::COUNTER => m.get_counter().get_value(),
                _ => m.get_gauge().get_value(),
            }
        };
        assert!(value("process_open_fds") >= 3.0);
        assert!(value("process_max_fds") >= value("process_open_fds"));
        assert!(value("process_resident_memory_bytes") > 0.0);
        assert!(value("process_virtual_memory_bytes") >= value("process_resident_memory_bytes"));
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs_f64();
        let start = value("process_start_time_seconds");
        assert!(start > 1.5e9 && start <= now + 1.0, "{start}");
    }
}
