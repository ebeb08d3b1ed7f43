//! Reading table `nftproxy` back: dumps of chains, rules, sets and elements, decoded into the
//! planner's [`TableState`]. Rules are decoded back into the ruleset model (the inverse of
//! `encode`), so chain fingerprints reflect what the kernel really holds.

use std::collections::{BTreeMap, HashMap};
use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::time::{Duration, Instant};

use dataplane::nft::build::{
    EXTERNAL_TO_CLUSTER_IPS, NODEPORT_TO_CLUSTER_IPS, NODEPORT_TO_SERVICE_PORTS,
};
use dataplane::nft::ruleset::{
    Action, BaseChain, Chain, ChainType, ElementMap, Family, Hook, Key, KeyType, Match, Proto,
    REGION_MODULUS, Rule, SetDecl, TABLE, Value, Verdict, endpoint_map_index, endpoint_map_name,
    region_elements_from_bounds,
};
use dataplane::nft::state::{ChainState, Elements, SetState, TableState, dnat_region, fingerprint};
use ipnet::IpNet;
use netlink_packet_core::{NetlinkMessage, NetlinkPayload};
use netlink_packet_netfilter::nftables::{
    ChainAttribute, ChainFlags, ChainMessage, GenAttribute, GenMessage, Hook as NlHook,
    NfTablesMessage, RuleAttribute, RuleMessage, SetAttribute, SetDescription, SetElementList,
    SetElementMessage, SetFlags, SetMessage, Verdict as NlVerdict,
};
use netlink_packet_netfilter::{NetfilterMessage, NetfilterMessageInner};

use super::encode::*;
use super::socket::{self, Notifications};
use super::{NftError, Nftables, Reply};

// Decoding, by object kind; this file reads (with retries while the table changes).
mod affinity;
mod decode;
mod nla;
mod rewrites;
mod rules;
mod sets;
mod shared;
#[cfg(test)]
mod tests;

use self::affinity::*;
pub use self::decode::decode_state;
use self::decode::*;
use self::nla::*;
use self::rules::*;
use self::sets::*;
pub(super) use self::sets::{decode_addr, decode_proto_port, raw_affinity_element, walk_elements};
use self::shared::*;

/// Comment given to sets that cannot be decoded: no desired declaration carries it, so the
/// planner recreates (or deletes) such a set.
pub const UNDECODABLE_SET_COMMENT: &str = "\0nftproxy: undecodable set";

const NFTA_RULE_TABLE: u16 = 1;
const NFTA_RULE_CHAIN: u16 = 2;
const NFTA_RULE_EXPRESSIONS: u16 = 4;
const NFTA_RULE_USERDATA: u16 = 7;

/// A read that keeps finding table `nftproxy` changed under it is retried for this long (and
/// at least [`MIN_READ_ATTEMPTS`] times), then fails.
const READ_DEADLINE: Duration = Duration::from_secs(10);
const MIN_READ_ATTEMPTS: u32 = 3;
/// Delays between attempts: from about 1 ms, doubling, at most 50 ms, with jitter.
const RETRY_BASE: Duration = Duration::from_millis(1);
const RETRY_CAP: Duration = Duration::from_millis(50);
/// Re-runs of an interrupted chain dump within one attempt (see [`dump_chains`]).
const CHAIN_DUMP_ATTEMPTS: u32 = 8;
/// How long to wait for the notifications of a commit we know has happened.
const NOTIFY_WAIT: Duration = Duration::from_millis(500);

/// How the last [`read_table`] went.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReadStats {
    /// Whole reads: 1 unless table `nftproxy` changed while it was read.
    pub attempts: u32,
    /// Dumps the kernel flagged as interrupted (`NLM_F_DUMP_INTR`: some commit, to any table,
    /// happened between two of its parts). Their results are kept unless a commit touched
    /// what the dump covers.
    pub interrupted_dumps: u32,
    /// Chain dumps run again because chains of the family were added or deleted meanwhile.
    pub chain_dump_retries: u32,
    /// Commits by others (to any table) while the successful attempt ran.
    pub foreign_commits: u32,
    pub elapsed: Duration,
}

/// What a read attempt found.
enum Attempt {
    Done(Option<TableState>),
    /// Table `nftproxy` (or what a dump depends on) changed meanwhile: why.
    Changed(&'static str),
}

/// Reads table `nftproxy` of `family`, retrying (with backoff) while the table changes under
/// the read.
///
/// nf_tables offers no snapshot: every commit, to any table of the network namespace, moves
/// the ruleset generation on and flags every dump running across it as interrupted. On a
/// node where another program commits often (every millisecond, say), a multi-part dump of a
/// large table is then interrupted almost every time, and a read that insisted on an
/// uninterrupted run would never finish. So a read listens to the change notifications while
/// it runs, and only a commit that touched *our* table (or, for the one dump the kernel does
/// not filter by table, added or deleted chains of the family) makes it start again; the
/// generation read before and after tells cheaply whether anyone committed at all. Without
/// the notifications (the socket cannot be opened), any interruption or generation change
/// counts as a change.
pub(super) fn read_table(
    nft: &mut Nftables,
    family: Family,
) -> Result<Option<TableState>, NftError> {
    let started = Instant::now();
    let mut stats = ReadStats::default();
    let mut delay = Delay::new();
    loop {
        stats.attempts += 1;
        let outcome = read_attempt(nft, family, &mut stats)?;
        stats.elapsed = started.elapsed();
        match outcome {
            Attempt::Done(state) => {
                if stats.attempts > 1 || stats.chain_dump_retries > 0 {
                    tracing::info!(
                        family = family.nft_name(), attempts = stats.attempts,
                        chain_dump_retries = stats.chain_dump_retries,
                        elapsed = ?stats.elapsed,
                        "read table nftproxy while it was being changed"
                    );
                }
                nft.last_read = stats;
                return Ok(state);
            }
            Attempt::Changed(why) => {
                nft.last_read = stats;
                if stats.elapsed >= READ_DEADLINE && stats.attempts >= MIN_READ_ATTEMPTS {
                    return Err(NftError::Request {
                        request: "read table",
                        errno: libc::EAGAIN,
                        source: io::Error::other(format!(
                            "table {} nftproxy kept changing while it was read ({why}; {} \
                             attempts in {:.1?}): another program is writing to it",
                            family.nft_name(),
                            stats.attempts,
                            stats.elapsed
                        )),
                    });
                }
                tracing::debug!(
                    family = family.nft_name(),
                    attempt = stats.attempts,
                    why,
                    "reading table nftproxy again"
                );
                std::thread::sleep(delay.next());
            }
        }
    }
}

/// Exponential delays with jitter (each in [d/2, d]), so that readers do not retry in step
/// with a writer.
struct Delay {
    next: Duration,
    seed: u64,
}

impl Delay {
    fn new() -> Delay {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0);
        Delay {
            next: RETRY_BASE,
            seed: (u64::from(nanos) << 16) ^ u64::from(std::process::id()) | 1,
        }
    }

    fn next(&mut self) -> Duration {
        let d = self.next;
        self.next = (d * 2).min(RETRY_CAP);
        self.seed ^= self.seed << 13;
        self.seed ^= self.seed >> 7;
        self.seed ^= self.seed << 17;
        let fraction = (self.seed >> 11) as f64 / (1u64 << 53) as f64;
        d.mul_f64(0.5 + 0.5 * fraction)
    }
}

fn read_attempt(
    nft: &mut Nftables,
    family: Family,
    stats: &mut ReadStats,
) -> Result<Attempt, NftError> {
    // Joined before the generation is read: every commit after that reaches us.
    let mut watch = match nft.notes.take().map(|n| CommitWatch::join(n, family)) {
        Some(Ok(w)) => Some(w),
        Some(Err((notes, e))) => {
            tracing::debug!(error = %e, "no change notifications for the read; any commit restarts it");
            nft.notes = Some(notes);
            None
        }
        None => None,
    };
    let result = attempt_watched(nft, family, watch.as_mut(), stats);
    if let Some(w) = watch {
        nft.notes = Some(w.leave());
    }
    result
}

fn attempt_watched(
    nft: &mut Nftables,
    family: Family,
    mut watch: Option<&mut CommitWatch>,
    stats: &mut ReadStats,
) -> Result<Attempt, NftError> {
    let before = generation(nft, family)?;
    if !nft.table_exists(family)? {
        return Ok(Attempt::Done(None));
    }
    let Some(state) = read_once(nft, family, watch.as_deref_mut(), stats)? else {
        return Ok(Attempt::Changed(
            "a dump was interrupted, or what it lists was deleted",
        ));
    };
    let after = generation(nft, family)?;
    let Some(watch) = watch else {
        return Ok(if after == before {
            Attempt::Done(Some(state))
        } else {
            Attempt::Changed("the ruleset generation moved")
        });
    };
    // The notifications of every commit up to `after` (a commit sends its own last).
    if after != before && !watch.wait_for(after, NOTIFY_WAIT) {
        return Ok(Attempt::Changed("change notifications did not arrive"));
    }
    watch.poll();
    if watch.changes.overflow {
        return Ok(Attempt::Changed("change notifications were lost"));
    }
    if watch.changes.ours {
        return Ok(Attempt::Changed("a commit changed it"));
    }
    stats.foreign_commits = watch.changes.commits;
    Ok(Attempt::Done(Some(state)))
}

fn request_error(request: &'static str, errno: i32) -> NftError {
    NftError::Request {
        request,
        errno,
        source: io::Error::from_raw_os_error(errno),
    }
}

/// Runs a dump of table `nftproxy`'s objects; the reply messages (netlink header included),
/// or `None` if the result cannot be used: interrupted by a commit while nothing tells which
/// tables the commit touched (no `watch`), or the table or set was deleted meanwhile.
fn dump(
    nft: &mut Nftables,
    what: &'static str,
    family: Family,
    msg: NfTablesMessage,
    watch: Option<&CommitWatch>,
    stats: &mut ReadStats,
) -> Result<Option<Vec<Vec<u8>>>, NftError> {
    match nft.request(what, family, msg, true)? {
        // The table existed when the read started.
        Reply::Errno(libc::ENOENT) => Ok(None),
        Reply::Errno(errno) => Err(request_error(what, errno)),
        Reply::Messages {
            messages,
            interrupted: true,
        } => {
            // The dump is filtered to our table (and set), whose objects only a commit to it
            // can change: the read's final check catches those.
            stats.interrupted_dumps += 1;
            Ok(watch.map(|_| messages))
        }
        Reply::Messages { messages, .. } => Ok(Some(messages)),
    }
}

/// The chain dump. The kernel ignores the table named in the request (6.18 lists every chain
/// of the family) and numbers its position across all tables, so chains added or deleted in
/// *another* table between two parts of the dump can make it skip or repeat one of ours. When
/// the dump was interrupted and the notifications show such a change, it is run again.
fn dump_chains(
    nft: &mut Nftables,
    family: Family,
    mut watch: Option<&mut CommitWatch>,
    stats: &mut ReadStats,
) -> Result<Option<Vec<Vec<u8>>>, NftError> {
    let mut delay = Delay::new();
    for _ in 0..CHAIN_DUMP_ATTEMPTS {
        if let Some(w) = watch.as_deref_mut() {
            w.poll();
            w.changes.chains_moved = false;
        }
        let msg = NfTablesMessage::GetChain(ChainMessage {
            attributes: vec![ChainAttribute::Table(TABLE.to_string())],
        });
        let messages = match nft.request("chain dump", family, msg, true)? {
            Reply::Errno(errno) => return Err(request_error("chain dump", errno)),
            Reply::Messages {
                messages,
                interrupted: false,
            } => return Ok(Some(messages)),
            Reply::Messages { messages, .. } => messages,
        };
        stats.interrupted_dumps += 1;
        let Some(w) = watch.as_deref_mut() else {
            return Ok(None);
        };
        let now = generation(nft, family)?;
        if !w.wait_for(now, NOTIFY_WAIT) || w.changes.overflow {
            return Ok(None);
        }
        if !w.changes.chains_moved {
            return Ok(Some(messages));
        }
        stats.chain_dump_retries += 1;
        std::thread::sleep(delay.next());
    }
    Ok(None)
}

/// nf_tables message types (the low byte of the netlink type, subsystem 10).
const NFNL_SUBSYS_NFTABLES: u16 = 10;
const NFT_MSG_NEWTABLE: u16 = 0;
const NFT_MSG_DELTABLE: u16 = 2;
const NFT_MSG_NEWCHAIN: u16 = 3;
const NFT_MSG_DELCHAIN: u16 = 5;
const NFT_MSG_NEWGEN: u16 = 15;
const NFT_MSG_GETGEN: u16 = 16;
const NFT_MSG_DESTROYTABLE: u16 = 26;
const NFT_MSG_DESTROYCHAIN: u16 = 27;
/// The generation id in a `NEWGEN` message; the table name in table, chain, rule, set,
/// element, object and flowtable messages.
const NFTA_GEN_ID: u16 = 1;
const NFTA_ANY_TABLE: u16 = 1;
const NFPROTO_IPV4: u8 = 2;
const NFPROTO_IPV6: u8 = 10;

/// What the nf_tables change notifications received during one read said.
#[derive(Debug, Default, PartialEq, Eq)]
struct Commits {
    /// A commit changed table `nftproxy` of the family.
    ours: bool,
    /// A commit added or deleted tables or chains of the family.
    chains_moved: bool,
    /// Notifications were lost.
    overflow: bool,
    /// The id of the last `NEWGEN` seen: every commit up to it has been seen whole.
    last_gen: Option<u32>,
    /// Commits seen.
    commits: u32,
}

impl Commits {
    /// Takes in one datagram of notifications; `family` is the read's `NFPROTO_*`.
    fn take_in(&mut self, datagram: &[u8], family: u8) {
        let Ok(msgs) = socket::messages(datagram) else {
            self.overflow = true;
            return;
        };
        for m in msgs {
            let (subsys, kind) = (m.kind >> 8, m.kind & 0xff);
            if subsys != NFNL_SUBSYS_NFTABLES || kind == NFT_MSG_GETGEN {
                continue;
            }
            let ours_family = m.bytes.get(16) == Some(&family);
            let Some(attrs) = message_nlas(m.bytes) else {
                // Cannot tell what it changed: assume the worst.
                self.ours |= ours_family;
                continue;
            };
            let attr = |t: u16| attrs.iter().find(|(k, _)| *k == t).map(|(_, v)| *v);
            if kind == NFT_MSG_NEWGEN {
                if let Some(id) = attr(NFTA_GEN_ID).and_then(be_u32) {
                    self.last_gen = Some(id);
                    self.commits += 1;
                }
                continue;
            }
            if !ours_family {
                continue;
            }
            if matches!(
                kind,
                NFT_MSG_NEWTABLE
                    | NFT_MSG_DELTABLE
                    | NFT_MSG_NEWCHAIN
                    | NFT_MSG_DELCHAIN
                    | NFT_MSG_DESTROYTABLE
                    | NFT_MSG_DESTROYCHAIN
            ) {
                self.chains_moved = true;
            }
            if attr(NFTA_ANY_TABLE).and_then(c_string).as_deref() == Some(TABLE) {
                self.ours = true;
            }
        }
    }

    /// Whether every commit up to generation `generation` has been seen whole.
    fn seen(&self, generation: u32) -> bool {
        // Generation ids only grow (wrapping, skipping 0).
        self.last_gen
            .is_some_and(|g| generation.wrapping_sub(g) as i32 <= 0)
    }
}

/// The change notifications during one read: the socket, subscribed, and what it said.
struct CommitWatch {
    notes: Notifications,
    /// `NFPROTO_*` of the family read.
    family: u8,
    changes: Commits,
}

impl CommitWatch {
    /// Subscribes `notes` for a read; gives it back with the error if that fails.
    fn join(
        mut notes: Notifications,
        family: Family,
    ) -> Result<CommitWatch, (Notifications, io::Error)> {
        if let Err(e) = notes.join() {
            notes.leave();
            return Err((notes, e));
        }
        Ok(CommitWatch {
            notes,
            family: match family {
                Family::V4 => NFPROTO_IPV4,
                Family::V6 => NFPROTO_IPV6,
            },
            changes: Commits::default(),
        })
    }

    /// Unsubscribes; the socket, for the next read.
    fn leave(mut self) -> Notifications {
        self.notes.leave();
        self.notes
    }

    /// Takes in what has arrived, without waiting.
    fn poll(&mut self) {
        while self.receive(Duration::ZERO) {}
    }

    /// Takes in notifications until the commit with generation `generation` has been seen
    /// whole; false if that takes longer than `wait` (or notifications were lost).
    fn wait_for(&mut self, generation: u32, wait: Duration) -> bool {
        let deadline = Instant::now() + wait;
        self.poll();
        loop {
            if self.changes.seen(generation) {
                return true;
            }
            if self.changes.overflow {
                return false;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            self.receive(left);
        }
    }

    /// Receives one datagram (waiting at most `wait`); false if there was none.
    fn receive(&mut self, wait: Duration) -> bool {
        match self.notes.recv(wait) {
            Ok(Some(datagram)) => {
                self.changes.take_in(datagram, self.family);
                true
            }
            Ok(None) => false,
            Err(e) => {
                // ENOBUFS: the kernel dropped notifications. Anything else: we cannot know.
                tracing::debug!(error = %e, "change notifications");
                self.changes.overflow = true;
                false
            }
        }
    }
}

/// Parses one reply message with the typed crate (tables, chains, sets, generation: few).
fn parse(what: &'static str, bytes: &[u8]) -> Result<Option<NfTablesMessage>, NftError> {
    match NetlinkMessage::<NetfilterMessage>::deserialize(bytes) {
        Ok(NetlinkMessage {
            payload:
                NetlinkPayload::InnerMessage(NetfilterMessage {
                    inner: NetfilterMessageInner::NfTables(m),
                    ..
                }),
            ..
        }) => Ok(Some(m)),
        Ok(_) => Ok(None),
        Err(e) => Err(NftError::Decode {
            request: what,
            reason: e.to_string(),
        }),
    }
}

fn parse_all(what: &'static str, msgs: &[Vec<u8>]) -> Result<Vec<NfTablesMessage>, NftError> {
    msgs.iter()
        .filter_map(|m| parse(what, m).transpose())
        .collect()
}

pub(super) fn generation(nft: &mut Nftables, family: Family) -> Result<u32, NftError> {
    let get = NfTablesMessage::GetGen(GenMessage { attributes: vec![] });
    match nft.request("get generation", family, get, false)? {
        Reply::Errno(errno) => Err(request_error("get generation", errno)),
        Reply::Messages { messages, .. } => {
            for bytes in &messages {
                if let Some(NfTablesMessage::NewGen(g)) = parse("get generation", bytes)? {
                    for a in g.attributes {
                        if let GenAttribute::Id(id) = a {
                            return Ok(id);
                        }
                    }
                }
            }
            Err(NftError::Decode {
                request: "get generation",
                reason: "no generation id in the reply".to_string(),
            })
        }
    }
}

/// One read of the whole table; `None` if a dump cannot be used (see [`dump`]).
fn read_once(
    nft: &mut Nftables,
    family: Family,
    mut watch: Option<&mut CommitWatch>,
    stats: &mut ReadStats,
) -> Result<Option<TableState>, NftError> {
    let Some(chains) = dump_chains(nft, family, watch.as_deref_mut(), stats)? else {
        return Ok(None);
    };
    let watch = watch.as_deref();
    let Some(rules) = dump(
        nft,
        "rule dump",
        family,
        NfTablesMessage::GetRule(RuleMessage {
            attributes: vec![RuleAttribute::Table(TABLE.to_string())],
        }),
        watch,
        stats,
    )?
    else {
        return Ok(None);
    };
    let Some(sets) = dump(
        nft,
        "set dump",
        family,
        NfTablesMessage::GetSet(SetMessage {
            attributes: vec![SetAttribute::Table(TABLE.to_string())],
        }),
        watch,
        stats,
    )?
    else {
        return Ok(None);
    };
    decode_state(family, &chains, &rules, &sets, |set| {
        dump(
            nft,
            "element dump",
            family,
            NfTablesMessage::GetSetElement(SetElementMessage {
                attributes: vec![
                    SetElementList::Table(TABLE.to_string()),
                    SetElementList::Set(set.to_string()),
                ],
            }),
            watch,
            stats,
        )
    })
}
