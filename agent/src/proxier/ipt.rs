//! The iptables proxier of one family (kube-proxy's iptables mode): the same interface as the
//! nftables one, over `iptables-restore` ([`IptablesBackend`]).

use std::time::Instant;

use dataplane::model::Cluster;
use dataplane::nft::build::BuildConfig;
use dataplane::nft::ruleset::{Family, TABLE};
use metrics::ObjectCounts;

use super::udp::UdpCleanup;
use super::{ChangedServices, FamilyReport, Phase, Probe, Proxier, SyncError};
use crate::config::ProxyMode;
use crate::iptables::{IptablesBackend, Variant};
use crate::nftables::Nftables;

pub struct IptablesProxier {
    backend: IptablesBackend,
    udp: UdpCleanup,
}

impl IptablesProxier {
    pub fn new(backend: IptablesBackend, udp: UdpCleanup) -> IptablesProxier {
        IptablesProxier { backend, udp }
    }
}

impl Proxier for IptablesProxier {
    fn family(&self) -> Family {
        self.backend.family()
    }

    fn mode(&self) -> ProxyMode {
        ProxyMode::Iptables
    }

    fn iptables_variant(&self) -> Option<Variant> {
        Some(self.backend.variant())
    }

    fn sync(
        &mut self,
        cluster: &Cluster,
        config: &BuildConfig,
        full: bool,
        changed: ChangedServices<'_>,
        probe: &mut dyn Probe,
    ) -> Result<FamilyReport, SyncError> {
        let family = self.family();
        if crate::testhooks::fail_family(family) {
            self.udp.forget_index();
            return Err(SyncError::Injected(family.k8s_name()));
        }
        let start = Instant::now();
        probe.enter(family, Phase::Commit);
        let r = match self.backend.sync(cluster, config, full) {
            Ok(r) => r,
            Err(e) => {
                // The backend forgets what it wrote itself.
                self.udp.forget_index();
                probe.enter(family, Phase::Done);
                return Err(e.into());
            }
        };
        let mut report = FamilyReport {
            ops: r.lines,
            messages: r.restores,
            bytes: r.bytes,
            no_local_endpoints: r.no_local_endpoints,
            objects: ObjectCounts {
                chains: r.chains,
                rules: r.rules,
                sets: 0,
                set_elements: 0,
            },
            iptables: Some(r.counts),
            ..FamilyReport::default()
        };
        probe.enter(family, Phase::Conntrack);
        // What a previous run programmed is not read back in iptables mode: the first
        // conntrack cleanup treats every UDP Service as possibly changed.
        self.udp.synced(cluster, changed, None);
        report.elapsed = start.elapsed();
        probe.enter(family, Phase::Done);
        Ok(report)
    }

    fn cleanup(&mut self) -> Result<(), SyncError> {
        super::log_removed(&self.backend.cleanup()?, "deleted iptables chains");
        self.udp.forget();
        Ok(())
    }

    fn remove_other_backend(&mut self) {
        let family = self.family();
        match Nftables::open().and_then(|mut nft| nft.delete_named_table(family, TABLE)) {
            Ok(true) => tracing::info!(
                table = format!("{} {TABLE}", family.nft_name()),
                "deleted table"
            ),
            Ok(false) => {}
            Err(e) => tracing::warn!(error = %e, "cannot remove nftables-mode leftovers"),
        }
    }
}
