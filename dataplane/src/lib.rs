//! nftproxy's pure core: the Service model, endpoint selection, the typed nftables ruleset,
//! its planner and its renderer. No I/O, no async runtime, no kernel access.

pub mod conflicts;
pub mod conntrack;
pub mod convert;
pub mod decision;
pub mod input;
pub mod iptables;
pub mod model;
pub mod net;
pub mod nft;
pub mod settings;
pub mod topology;
pub mod trace;
pub mod tracker;
