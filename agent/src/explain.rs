//! Puts a packet trace into words for `nftproxy trace`.

use std::fmt::Write;

use dataplane::trace::{Host, Outcome, Packet, Trace};

pub fn explain(pkt: &Packet, host: &Host, trace: &Trace) -> String {
    let mut out = String::new();
    let path = if host.local_addresses.contains(&pkt.src) {
        "sent by this node (output hooks)"
    } else {
        "arriving from a pod or another host (prerouting hooks)"
    };
    let _ = writeln!(
        out,
        "packet:   {} {} -> {}, {path}",
        pkt.proto, pkt.src, pkt.dst
    );
    if trace.services.is_empty() {
        let _ = writeln!(out, "service:  none matched");
    } else {
        let names: Vec<&str> = trace.services.iter().map(String::as_str).collect();
        let _ = writeln!(out, "service:  {}", names.join(", "));
    }
    // Several Services claim the destination: say who gets it and why (docs: Conflicting
    // frontends).
    for c in &trace.conflicts {
        let _ = writeln!(out, "conflict: {c}");
    }
    if let Some(to) = trace.shared_list {
        let _ = writeln!(
            out,
            "via:      {to}: the destination is rewritten to the ClusterIP's, whose endpoint \
             list it shares (conntrack keeps {} for the replies)",
            pkt.dst
        );
    }
    let endpoints: Vec<&Outcome> = trace
        .outcomes
        .iter()
        .filter(|o| matches!(o, Outcome::Endpoint { .. }))
        .collect();
    if !endpoints.is_empty() {
        let how = if endpoints.len() > 1 {
            format!("one of {} endpoints, chosen at random", endpoints.len())
        } else {
            "its only endpoint".to_string()
        };
        let _ = writeln!(out, "verdict:  DNAT to {how}");
        if trace.redraws {
            let _ = writeln!(
                out,
                "          (drawn on the flat path for large Services: a random index past the \
                 list is drawn again, up to {} times, then the first endpoint is taken)",
                dataplane::nft::build::DRAWS
            );
        }
        for o in &endpoints {
            if let Outcome::Endpoint { addr, masquerade } = o {
                let src = if *masquerade {
                    "source masqueraded to the node's address"
                } else {
                    "client source address kept"
                };
                let _ = writeln!(out, "          {addr:<28} {src}");
            }
        }
    }
    for o in &trace.outcomes {
        let line = match o {
            Outcome::Drop => "verdict:  DROP (the client times out)",
            Outcome::Reject => "verdict:  REJECT (the client sees connection refused)",
            Outcome::Untouched => {
                "verdict:  not handled by nftproxy; the host routes or delivers it"
            }
            Outcome::Endpoint { .. } => continue,
        };
        let _ = writeln!(out, "{line}");
    }
    let _ = writeln!(out, "chains:   {}", trace.chains.join(" -> "));
    out
}
