//! The nftables backend's pure part: the typed ruleset, the table builder, the desired table kept
//! between syncs, the planner and the nft text renderer.

pub mod build;
pub mod cold;
pub mod desired;
pub mod plan;
pub mod regions;
pub mod render;
pub mod ruleset;
pub mod state;
pub mod transaction;
