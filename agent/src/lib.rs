//! The nftproxy node agent: configuration, sources, the sync loop and the kernel backends.

pub mod addresses;
pub mod apiclient;
pub mod backoff;
pub mod client_metrics;
pub mod clock;
pub mod config;
pub mod conntrack;
pub mod demo;
pub mod explain;
pub mod http;
pub mod iptables;
pub mod memory;
pub mod nftables;
pub mod node_wait;
pub mod prefetch;
pub mod proxier;
pub mod quarantine;
pub mod ratelimit;
pub mod source;
pub mod syncloop;
pub mod telemetry;
pub mod testhooks;
pub mod watch;
