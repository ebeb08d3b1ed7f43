//! The iptables binaries: which variant (legacy or nft) the node uses, and running its
//! `-save` / `-restore` tools.
//!
//! Debian's `iptables` package installs both variants side by side (`iptables-legacy`,
//! `iptables-nft`, and their `-save` / `-restore` tools, `ip6tables-*` alike). Rules written
//! with one are invisible to the other and run in a different order relative to the host's own
//! rules, so nftproxy uses the variant the node already uses, found the way the ecosystem finds
//! it (`kubernetes-sigs/iptables-wrappers`): kubelet's `KUBE-IPTABLES-HINT` (or older
//! `KUBE-KUBELET-CANARY`) chain in the `mangle` table tells, else the variant holding more
//! rules wins, else nft.

use std::fmt;
use std::io::Write as _;
use std::path::PathBuf;
use std::process::{Command, Stdio};

use dataplane::iptables::IptTable;
use dataplane::nft::ruleset::Family;

/// Seconds `iptables-restore` waits for the xtables lock (`/run/xtables.lock`, legacy only),
/// as kube-proxy.
pub const LOCK_WAIT_SECONDS: u32 = 5;

/// What went wrong running an iptables tool.
#[derive(Debug, thiserror::Error)]
pub enum IptError {
    #[error("{binary} not found: install iptables (both the legacy and nft variants)")]
    Missing { binary: String },
    #[error("running {binary}: {source}")]
    Spawn {
        binary: String,
        #[source]
        source: std::io::Error,
    },
    /// The tool ran and failed; for a restore, nothing of the failing table was committed.
    #[error("{binary} failed ({status}): {stderr}{context}")]
    Failed {
        binary: String,
        status: String,
        stderr: String,
        /// The restore input around the line the tool complained about.
        context: String,
    },
}

/// The two implementations of the iptables command-line API.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Variant {
    /// The kernel's x_tables (`ip_tables`, `ip6_tables`).
    Legacy,
    /// x_tables rules translated to nf_tables (`table ip filter`, `table ip nat`, ...).
    Nft,
}

impl Variant {
    pub const ALL: [Variant; 2] = [Variant::Legacy, Variant::Nft];

    pub fn name(self) -> &'static str {
        match self {
            Variant::Legacy => "legacy",
            Variant::Nft => "nft",
        }
    }
}

impl fmt::Display for Variant {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Finds `name` on `$PATH`, then in `/usr/sbin` and `/sbin` (often missing from a user's path).
fn find_binary(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain([PathBuf::from("/usr/sbin"), PathBuf::from("/sbin")])
        .map(|dir| dir.join(name))
        .find(|p| p.is_file())
}

/// One variant's tools for one family.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Xtables {
    pub variant: Variant,
    pub family: Family,
}

impl Xtables {
    pub fn new(variant: Variant, family: Family) -> Xtables {
        Xtables { variant, family }
    }

    /// `iptables-legacy-restore`, `ip6tables-nft-save`, `iptables-nft` (for `tool == ""`).
    pub fn binary_name(&self, tool: &str) -> String {
        let base = match self.family {
            Family::V4 => "iptables",
            Family::V6 => "ip6tables",
        };
        if tool.is_empty() {
            format!("{base}-{}", self.variant)
        } else {
            format!("{base}-{}-{tool}", self.variant)
        }
    }

    fn command(&self, tool: &str) -> Result<(String, Command), IptError> {
        let name = self.binary_name(tool);
        match find_binary(&name) {
            Some(path) => Ok((name, Command::new(path))),
            None => Err(IptError::Missing { binary: name }),
        }
    }

    /// Whether this variant's tools are installed.
    pub fn available(&self) -> bool {
        find_binary(&self.binary_name("save")).is_some()
            && find_binary(&self.binary_name("restore")).is_some()
    }

    /// `iptables-save` of one table, or of every table the kernel has loaded. (A legacy
    /// `-t TABLE` creates the table if the kernel does not have it yet.)
    pub fn save(&self, table: Option<&str>) -> Result<String, IptError> {
        let (binary, mut cmd) = self.command("save")?;
        if let Some(t) = table {
            cmd.args(["-t", t]);
        }
        let out = cmd
            .stdin(Stdio::null())
            .output()
            .map_err(|source| IptError::Spawn {
                binary: binary.clone(),
                source,
            })?;
        if !out.status.success() {
            return Err(IptError::Failed {
                binary,
                status: out.status.to_string(),
                stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
                context: String::new(),
            });
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// `iptables-save` of nftproxy's tables (`filter`, `nat`).
    pub fn save_ours(&self) -> Result<String, IptError> {
        let mut text = String::new();
        for table in IptTable::ALL {
            text.push_str(&self.save(Some(table.name()))?);
        }
        Ok(text)
    }

    /// `iptables-restore --noflush`: each table of `input` is committed atomically; tables and
    /// chains the input does not mention stay as they are.
    pub fn restore(&self, input: &str) -> Result<(), IptError> {
        let (binary, mut cmd) = self.command("restore")?;
        cmd.arg("--noflush")
            .arg(format!("--wait={LOCK_WAIT_SECONDS}"));
        if self.variant == Variant::Legacy {
            // Poll the lock every 100 ms (iptables-nft takes no lock and warns about this).
            cmd.args(["-W", "100000"]);
        }
        let mut child = cmd
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|source| IptError::Spawn {
                binary: binary.clone(),
                source,
            })?;
        let written = child
            .stdin
            .take()
            .expect("piped stdin")
            .write_all(input.as_bytes());
        let out = child.wait_with_output().map_err(|source| IptError::Spawn {
            binary: binary.clone(),
            source,
        })?;
        if out.status.success() {
            if let Err(source) = written {
                return Err(IptError::Spawn { binary, source });
            }
            return Ok(());
        }
        let stderr = String::from_utf8_lossy(&out.stderr).trim().to_string();
        let context = failed_line(&stderr)
            .map(|n| {
                let lines: Vec<&str> = input.lines().collect();
                let from = n.saturating_sub(2);
                let to = (n + 1).min(lines.len());
                let shown: Vec<String> = (from..to)
                    .map(|i| format!("{:>6}: {}", i + 1, lines[i]))
                    .collect();
                format!("\n{}", shown.join("\n"))
            })
            .unwrap_or_default();
        Err(IptError::Failed {
            binary,
            status: out.status.to_string(),
            stderr,
            context,
        })
    }

    /// Whether `chain` exists in `table` (the canary check).
    pub fn chain_exists(&self, table: &str, chain: &str) -> Result<bool, IptError> {
        let (binary, mut cmd) = self.command("")?;
        let status = cmd
            .args([
                &format!("--wait={LOCK_WAIT_SECONDS}"),
                "-t",
                table,
                "-S",
                chain,
                "1",
            ])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .map_err(|source| IptError::Spawn { binary, source })?;
        Ok(status.success())
    }
}

/// The 1-based line number in "iptables-restore: line 12 failed".
fn failed_line(stderr: &str) -> Option<usize> {
    let at = stderr.find("line ")?;
    let digits: String = stderr[at + 5..]
        .chars()
        .take_while(char::is_ascii_digit)
        .collect();
    digits.parse().ok()
}

/// kubelet's chains that name the variant it uses.
fn has_kubelet_hint(save: &str) -> bool {
    save.lines()
        .any(|l| l.starts_with(":KUBE-IPTABLES-HINT ") || l.starts_with(":KUBE-KUBELET-CANARY "))
}

fn rule_lines(save: &str) -> usize {
    save.lines().filter(|l| l.starts_with('-')).count()
}

/// The variant this node uses, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Detection {
    pub variant: Variant,
    pub reason: String,
}

/// Finds the variant the node uses. Errors of the tools count as "nothing there".
pub fn detect() -> Detection {
    let save = |variant, family, table: Option<&str>| {
        Xtables::new(variant, family)
            .save(table)
            .unwrap_or_default()
    };
    // kubelet creates KUBE-IPTABLES-HINT in mangle with the variant it uses. iptables-nft can
    // list mangle cheaply and without creating it; iptables-legacy-save -t mangle would create
    // the table, so the legacy check reads every loaded table instead.
    for family in Family::ALL {
        if has_kubelet_hint(&save(Variant::Nft, family, Some("mangle"))) {
            return Detection {
                variant: Variant::Nft,
                reason: format!(
                    "kubelet's KUBE-IPTABLES-HINT chain is in {} iptables-nft",
                    family.k8s_name()
                ),
            };
        }
    }
    let mut legacy_rules = 0;
    for family in Family::ALL {
        let text = save(Variant::Legacy, family, None);
        if has_kubelet_hint(&text) {
            return Detection {
                variant: Variant::Legacy,
                reason: format!(
                    "kubelet's KUBE-IPTABLES-HINT chain is in {} iptables-legacy",
                    family.k8s_name()
                ),
            };
        }
        legacy_rules += rule_lines(&text);
    }
    let nft_rules: usize = Family::ALL
        .iter()
        .map(|f| rule_lines(&save(Variant::Nft, *f, None)))
        .sum();
    if legacy_rules > nft_rules {
        Detection {
            variant: Variant::Legacy,
            reason: format!(
                "no KUBE-IPTABLES-HINT chain; iptables-legacy holds more rules ({legacy_rules}) than iptables-nft ({nft_rules})"
            ),
        }
    } else {
        Detection {
            variant: Variant::Nft,
            reason: format!(
                "no KUBE-IPTABLES-HINT chain; iptables-nft holds as many rules or more ({nft_rules}) than iptables-legacy ({legacy_rules})"
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failed_lines_and_hints() {
        assert_eq!(failed_line("iptables-restore: line 12 failed"), Some(12));
        assert_eq!(
            failed_line("iptables-restore v1.8.9 (nf_tables): line 3: RULE_APPEND failed"),
            Some(3)
        );
        assert_eq!(failed_line("something else"), None);
        assert!(has_kubelet_hint(
            "*mangle\n:PREROUTING ACCEPT [0:0]\n:KUBE-IPTABLES-HINT - [0:0]\nCOMMIT\n"
        ));
        assert!(!has_kubelet_hint("*mangle\n-A X -j KUBE-IPTABLES-HINT\n"));
        assert_eq!(
            rule_lines("*nat\n:X - [0:0]\n-A X -j RETURN\n-A X -j RETURN\nCOMMIT\n"),
            2
        );
        let x = Xtables::new(Variant::Legacy, Family::V6);
        assert_eq!(x.binary_name("restore"), "ip6tables-legacy-restore");
        assert_eq!(x.binary_name(""), "ip6tables-legacy");
    }
}
