//! Reading table `nftproxy` back: dumps of chains, rules, sets and elements, decoded into the
//! planner's [`TableState`]. Rules are decoded back into the ruleset model (the inverse of
//! `encode`), so chain fingerprints reflect what the kernel really holds.

use std::collections::{BTreeMap, HashMap};
use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::time::{Duration, Instant};

use dataplane::nft::plan::fingerprint;
use dataplane::nft::ruleset::{
    Action, BaseChain, Chain, ChainType, Family, Hook, Key, KeyType, Match, Proto, Rule,
    SLOT_MODULUS, SetDecl, TABLE, Value, Verdict, endpoint_map_index, endpoint_map_name,
    slot_elements_from_bounds,
};
use dataplane::nft::state::{ChainState, Elements, SetState, TableState, dnat_slot};
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
    let mut watch = match nft.notes.take().map(|n| ChangeWatch::join(n, family)) {
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
    mut watch: Option<&mut ChangeWatch>,
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
    watch: Option<&ChangeWatch>,
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
    mut watch: Option<&mut ChangeWatch>,
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
struct Changes {
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

impl Changes {
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
struct ChangeWatch {
    notes: Notifications,
    /// `NFPROTO_*` of the family read.
    family: u8,
    changes: Changes,
}

impl ChangeWatch {
    /// Subscribes `notes` for a read; gives it back with the error if that fails.
    fn join(
        mut notes: Notifications,
        family: Family,
    ) -> Result<ChangeWatch, (Notifications, io::Error)> {
        if let Err(e) = notes.join() {
            notes.leave();
            return Err((notes, e));
        }
        Ok(ChangeWatch {
            notes,
            family: match family {
                Family::V4 => NFPROTO_IPV4,
                Family::V6 => NFPROTO_IPV6,
            },
            changes: Changes::default(),
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

// --- Raw attribute walking. ---
//
// Rules and set elements are parsed by hand rather than with the typed crate: its parsers
// format a debug dump of the whole remaining buffer as error context for every attribute they
// visit, even on success, which made reading 40,000 rules take over 10 seconds.

/// Netlink attributes of `buf` as (type without the nested/byte-order flags, payload); `None`
/// if malformed.
fn nlas(buf: &[u8]) -> Option<Vec<(u16, &[u8])>> {
    let mut out = Vec::new();
    let mut rest = buf;
    while rest.len() >= 4 {
        let len = usize::from(u16::from_ne_bytes([rest[0], rest[1]]));
        let kind = u16::from_ne_bytes([rest[2], rest[3]]) & NLA_TYPE_MASK;
        if len < 4 || len > rest.len() {
            return None;
        }
        out.push((kind, &rest[4..len]));
        // Attributes are 4-byte aligned (NLA_ALIGN).
        rest = rest.get((len + 3) & !3..).unwrap_or(&[]);
    }
    Some(out)
}

type Attrs<'a> = BTreeMap<u16, &'a [u8]>;

/// Attributes by type (the last one wins; used where types do not repeat).
fn attr_map(buf: &[u8]) -> Option<Attrs<'_>> {
    Some(nlas(buf)?.into_iter().collect())
}

/// The attributes of a netlink message: after nlmsghdr (16 bytes) and nfgenmsg (4 bytes).
fn message_nlas(msg: &[u8]) -> Option<Vec<(u16, &[u8])>> {
    nlas(msg.get(20..)?)
}

fn be_u32(b: &[u8]) -> Option<u32> {
    Some(u32::from_be_bytes(b.try_into().ok()?))
}

fn c_string(b: &[u8]) -> Option<String> {
    let end = b.iter().position(|&c| c == 0).unwrap_or(b.len());
    String::from_utf8(b[..end].to_vec()).ok()
}

const NFTA_VERDICT_CODE: u16 = 1;
const NFTA_VERDICT_CHAIN: u16 = 2;

/// The bytes of an `NFTA_DATA_VALUE` nest.
fn data_value(b: &[u8]) -> Option<Vec<u8>> {
    match nlas(b)?.as_slice() {
        [(NFTA_DATA_VALUE, v)] => Some(v.to_vec()),
        _ => None,
    }
}

/// The verdict of an `NFTA_DATA_VERDICT` nest.
fn data_verdict(b: &[u8]) -> Option<Verdict> {
    let nest = nlas(b)?;
    let [(NFTA_DATA_VERDICT, v)] = nest.as_slice() else {
        return None;
    };
    let a = attr_map(v)?;
    if !a
        .keys()
        .all(|k| [NFTA_VERDICT_CODE, NFTA_VERDICT_CHAIN].contains(k))
    {
        return None;
    }
    let chain = a.get(&NFTA_VERDICT_CHAIN).and_then(|c| c_string(c));
    Some(
        match (NlVerdict::from(be_u32(a.get(&NFTA_VERDICT_CODE)?)?), chain) {
            (NlVerdict::Other(NF_ACCEPT), None) => Verdict::Accept,
            (NlVerdict::Other(NF_DROP), None) => Verdict::Drop,
            (NlVerdict::Return, None) => Verdict::Return,
            (NlVerdict::Jump, Some(c)) => Verdict::Jump(c.into()),
            (NlVerdict::Goto, Some(c)) => Verdict::Goto(c.into()),
            _ => return None,
        },
    )
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
    mut watch: Option<&mut ChangeWatch>,
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

/// Decodes the replies of a table's chain, rule and set dumps into its state; `dump_elements`
/// runs the element dump of one set (`None`: its result cannot be used, nor then the state's).
/// Public (hidden) for the fuzz tests, which feed it raw and mutated messages.
#[doc(hidden)]
pub fn decode_state(
    family: Family,
    chains: &[Vec<u8>],
    rules: &[Vec<u8>],
    sets: &[Vec<u8>],
    mut dump_elements: impl FnMut(&str) -> Result<Option<Vec<Vec<u8>>>, NftError>,
) -> Result<Option<TableState>, NftError> {
    // Rules per chain, in order; `None` for a rule nftproxy does not write.
    let mut chain_rules: HashMap<String, Vec<Option<Rule>>> = HashMap::new();
    for m in rules {
        let Some(attrs) = message_nlas(m) else {
            return Err(NftError::Decode {
                request: "rule dump",
                reason: "malformed rule message".to_string(),
            });
        };
        let mut table = None;
        let mut chain = None;
        let mut exprs = None;
        let mut comment = Ok(None);
        for (kind, value) in attrs {
            match kind {
                NFTA_RULE_TABLE => table = c_string(value),
                NFTA_RULE_CHAIN => chain = c_string(value),
                NFTA_RULE_EXPRESSIONS => exprs = Some(value),
                NFTA_RULE_USERDATA => comment = udata_string(value, UDATA_RULE_COMMENT),
                _ => {}
            }
        }
        if table.as_deref().is_some_and(|t| t != TABLE) {
            continue;
        }
        let Some(chain) = chain else { continue };
        let rule = match (exprs, comment) {
            (Some(e), Ok(comment)) => decode_rule(family, e, comment),
            _ => None,
        };
        if rule.is_none() {
            tracing::debug!(chain, "rule in table nftproxy not written by nftproxy");
        }
        chain_rules.entry(chain).or_default().push(rule);
    }

    let mut state = TableState::default();
    for m in parse_all("chain dump", chains)? {
        let NfTablesMessage::NewChain(c) = m else {
            continue;
        };
        if let Some((name, chain)) = decode_chain(c, &mut chain_rules) {
            state.chains.insert(name.into(), chain);
        }
    }

    let sets: Vec<Vec<u8>> = sets.iter().map(|m| opaque_set_expressions(m)).collect();
    for m in parse_all("set dump", &sets)? {
        let NfTablesMessage::NewSet(s) = m else {
            continue;
        };
        let Some(raw) = RawSet::from_message(s) else {
            continue;
        };
        let decl = raw.decl(family);
        let mut elements = BTreeMap::new();
        let mut decodable = decl.is_some();
        if let Some(d) = &decl
            && d.timeout_secs.is_none()
        {
            let Some(msgs) = dump_elements(&raw.name)? else {
                return Ok(None);
            };
            decodable = decode_elements(family, d, &msgs, &mut elements);
        }
        let state_entry = match decl {
            Some(decl) if decodable => SetState {
                decl,
                elements: Elements::Read(elements),
            },
            _ => SetState {
                decl: SetDecl {
                    key: KeyType::Addr,
                    is_vmap: false,
                    comment: Some(UNDECODABLE_SET_COMMENT.to_string()),
                    timeout_secs: None,
                    size: None,
                },
                elements: Elements::Read(BTreeMap::new()),
            },
        };
        state.sets.insert(raw.name, state_entry);
    }
    Ok(Some(state))
}

const NFTA_SET_EXPR: u16 = 17;
const NFTA_SET_EXPRESSIONS: u16 = 18;

/// A set message with its expressions (`NFTA_SET_EXPR`, `NFTA_SET_EXPRESSIONS`) retyped as
/// `NFTA_SET_UNSPEC`, which the typed crate keeps as opaque bytes: it parses expressions
/// without checking their lengths and panics on malformed ones. nftproxy writes none and
/// ignores them anyway.
fn opaque_set_expressions(msg: &[u8]) -> Vec<u8> {
    let mut out = msg.to_vec();
    let mut at = 20; // nlmsghdr and nfgenmsg
    while at + 4 <= out.len() {
        let len = usize::from(u16::from_ne_bytes([out[at], out[at + 1]]));
        let kind = u16::from_ne_bytes([out[at + 2], out[at + 3]]) & NLA_TYPE_MASK;
        if len < 4 {
            break;
        }
        if kind == NFTA_SET_EXPR || kind == NFTA_SET_EXPRESSIONS {
            out[at + 2..at + 4].fill(0);
        }
        at += (len + 3) & !3;
    }
    out
}

/// The string of user-data TLV `kind`, if present.
fn udata_string(udata: &[u8], kind: u8) -> Result<Option<String>, ()> {
    let mut rest = udata;
    while rest.len() >= 2 {
        let (t, len) = (rest[0], usize::from(rest[1]));
        let value = rest.get(2..2 + len).ok_or(())?;
        if t == kind {
            let end = value.iter().position(|&b| b == 0).unwrap_or(value.len());
            return String::from_utf8(value[..end].to_vec())
                .map(Some)
                .map_err(|_| ());
        }
        rest = &rest[2 + len..];
    }
    Ok(None)
}

fn hook_of(n: u32) -> Option<Hook> {
    Some(match n {
        0 => Hook::Prerouting,
        1 => Hook::Input,
        2 => Hook::Forward,
        3 => Hook::Output,
        4 => Hook::Postrouting,
        _ => return None,
    })
}

/// A base chain nftproxy would not create: never equal to a desired one.
const FOREIGN_BASE: BaseChain = BaseChain {
    chain_type: ChainType::Filter,
    hook: Hook::Prerouting,
    priority: i32::MIN,
};

fn decode_chain(
    c: ChainMessage,
    rules: &mut HashMap<String, Vec<Option<Rule>>>,
) -> Option<(String, ChainState)> {
    let mut table = None;
    let mut name = None;
    let mut hook = None;
    let mut prio = None;
    let mut chain_type = None;
    let mut policy = None;
    let mut binding = false;
    for a in c.attributes {
        match a {
            ChainAttribute::Table(t) => table = Some(t),
            ChainAttribute::Name(n) => name = Some(n),
            ChainAttribute::Hook(h) => {
                for x in h {
                    match x {
                        NlHook::Number(n) => hook = Some(u32::from(n)),
                        NlHook::Priority(p) => prio = Some(p as i32),
                        _ => {}
                    }
                }
            }
            ChainAttribute::Type(t) => chain_type = Some(t),
            ChainAttribute::Policy(p) => policy = Some(p),
            ChainAttribute::Flags(f) => binding = f.contains(ChainFlags::Binding),
            _ => {}
        }
    }
    if table.as_deref() != Some(TABLE) || binding {
        return None;
    }
    let name = name?;
    let base = match hook {
        None => None,
        Some(h) => {
            let t = match chain_type.as_deref() {
                Some("filter") => Some(ChainType::Filter),
                Some("nat") => Some(ChainType::Nat),
                _ => None,
            };
            match (hook_of(h), t, prio, policy.unwrap_or(NF_ACCEPT)) {
                (Some(hook), Some(chain_type), Some(priority), NF_ACCEPT) => Some(BaseChain {
                    chain_type,
                    hook,
                    priority,
                }),
                _ => Some(FOREIGN_BASE),
            }
        }
    };
    let decoded = rules.remove(&name).unwrap_or_default();
    let empty = decoded.is_empty();
    // A rule nftproxy does not write makes the fingerprint unknown: the planner rewrites it.
    let decoded = decoded.into_iter().collect::<Option<Vec<Rule>>>();
    let slot = decoded.as_deref().and_then(dnat_slot);
    let fingerprint = decoded.map(|rules| {
        fingerprint(&Chain {
            base,
            comment: None,
            rules: rules.into(),
        })
    });
    Some((
        name,
        ChainState {
            base,
            fingerprint,
            empty,
            slot,
        },
    ))
}

// --- Sets and elements. ---

struct RawSet {
    name: String,
    flags: SetFlags,
    key_type: Option<u32>,
    key_len: Option<u32>,
    data_type: Option<u32>,
    data_len: Option<u32>,
    timeout_ms: Option<u64>,
    size: Option<u32>,
    comment: Result<Option<String>, ()>,
}

impl RawSet {
    fn from_message(s: SetMessage) -> Option<RawSet> {
        let mut table = None;
        let mut raw = RawSet {
            name: String::new(),
            flags: SetFlags::empty(),
            key_type: None,
            key_len: None,
            data_type: None,
            data_len: None,
            timeout_ms: None,
            size: None,
            comment: Ok(None),
        };
        for a in s.attributes {
            match a {
                SetAttribute::Table(t) => table = Some(t),
                SetAttribute::Name(n) => raw.name = n,
                SetAttribute::Flags(f) => raw.flags = f,
                SetAttribute::KeyType(t) => raw.key_type = Some(t),
                SetAttribute::KeyLen(l) => raw.key_len = Some(l),
                SetAttribute::DataType(t) => raw.data_type = Some(t),
                SetAttribute::DataLen(l) => raw.data_len = Some(l),
                SetAttribute::Timeout(t) => raw.timeout_ms = Some(t),
                SetAttribute::Description(d) => {
                    for desc in d {
                        if let SetDescription::Size(n) = desc {
                            raw.size = Some(n).filter(|n| *n > 0);
                        }
                    }
                }
                SetAttribute::UserData(u) => raw.comment = udata_string(&u, UDATA_SET_COMMENT),
                _ => {}
            }
        }
        // Anonymous sets belong to the rule that uses them.
        if table.as_deref() != Some(TABLE)
            || raw.name.is_empty()
            || raw.flags.contains(SetFlags::Anonymous)
        {
            return None;
        }
        Some(raw)
    }

    /// The declaration, if nftproxy could have written it.
    fn decl(&self, family: Family) -> Option<SetDecl> {
        if self.flags.contains(SetFlags::Interval) {
            return self.endpoint_decl(family);
        }
        let known = SetFlags::Map | SetFlags::Timeout | SetFlags::Eval;
        if !(self.flags - known).is_empty() {
            return None;
        }
        if self.flags == SetFlags::Map && self.data_type == Some(endpoint_data_layout(family).0) {
            return self.endpoint_decl(family);
        }
        let is_vmap = self.flags.contains(SetFlags::Map);
        if is_vmap != (self.data_type == Some(NFT_DATA_VERDICT)) {
            return None;
        }
        let dynamic = self.flags.contains(SetFlags::Timeout | SetFlags::Eval);
        if !dynamic && self.flags.intersects(SetFlags::Timeout | SetFlags::Eval) {
            return None;
        }
        let timeout_secs = if dynamic {
            let ms = self.timeout_ms?;
            if ms % 1000 != 0 {
                return None;
            }
            Some(u32::try_from(ms / 1000).ok()?)
        } else {
            None
        };
        let key = self.key_among(
            family,
            &[
                KeyType::Addr,
                KeyType::AddrProtoPort,
                KeyType::ProtoPort,
                KeyType::AddrPair,
            ],
        )?;
        Some(SetDecl {
            key,
            is_vmap,
            comment: self.comment.clone().ok()?,
            timeout_secs,
            // The kernel gives dynamic sets a size of its own (65535), which nft hides too.
            size: self.size.filter(|_| !dynamic),
        })
    }

    /// The key type among `candidates` whose type id and length the set has.
    fn key_among(&self, family: Family, candidates: &[KeyType]) -> Option<KeyType> {
        candidates.iter().copied().find(|k| {
            let (t, l) = key_layout(family, *k);
            Some(l) == self.key_len && Some(t) == self.key_type
        })
    }

    /// A map of endpoints (to the family's `ADDR . inet_service`): an endpoint-list map, a
    /// plain map from `[ADDR .] inet_proto . inet_service . integer`, or an endpoint map, an
    /// interval map (nothing else) from 4-byte values. An endpoint map's key type id is not
    /// checked: only nft reads it, and the elements mean the same whatever it is.
    fn endpoint_decl(&self, family: Family) -> Option<SetDecl> {
        let (data_type, data_len) = endpoint_data_layout(family);
        if (self.data_type, self.data_len) != (Some(data_type), Some(data_len)) {
            return None;
        }
        let key = if self.flags == SetFlags::Interval | SetFlags::Map {
            (self.key_len == Some(4)).then_some(KeyType::Slot)?
        } else if self.flags == SetFlags::Map {
            self.key_among(
                family,
                &[KeyType::AddrProtoPortIndex, KeyType::ProtoPortIndex],
            )?
        } else {
            return None;
        };
        Some(SetDecl {
            comment: self.comment.clone().ok()?,
            size: self.size,
            ..SetDecl::new(key)
        })
    }
}

fn decode_addr(b: &[u8]) -> Option<IpAddr> {
    match b.len() {
        4 => Some(IpAddr::V4(Ipv4Addr::from(<[u8; 4]>::try_from(b).ok()?))),
        16 => Some(IpAddr::V6(Ipv6Addr::from(<[u8; 16]>::try_from(b).ok()?))),
        _ => None,
    }
}

fn decode_proto_port(b: &[u8]) -> Option<(Proto, u16)> {
    if b.len() != 8 || b[1..4] != [0, 0, 0] || b[6..8] != [0, 0] {
        return None;
    }
    Some((Proto::from_number(b[0])?, u16::from_be_bytes([b[4], b[5]])))
}

fn decode_key(family: Family, key: KeyType, b: &[u8]) -> Option<Key> {
    let alen = addr_layout(family).2 as usize;
    match key {
        KeyType::Addr if b.len() == alen => Some(Key::Addr(decode_addr(b)?)),
        KeyType::AddrProtoPort if b.len() == alen + 8 => {
            let (p, port) = decode_proto_port(&b[alen..])?;
            Some(Key::AddrProtoPort(decode_addr(&b[..alen])?, p, port))
        }
        KeyType::ProtoPort => {
            let (p, port) = decode_proto_port(b)?;
            Some(Key::ProtoPort(p, port))
        }
        KeyType::AddrProtoPortIndex if b.len() == alen + 12 => {
            let (p, port) = decode_proto_port(&b[alen..alen + 8])?;
            let i = u8::try_from(u32_ne(&b[alen + 8..])?).ok()?;
            Some(Key::AddrProtoPortIndex(
                decode_addr(&b[..alen])?,
                p,
                port,
                i,
            ))
        }
        KeyType::ProtoPortIndex if b.len() == 12 => {
            let (p, port) = decode_proto_port(&b[..8])?;
            let i = u8::try_from(u32_ne(&b[8..])?).ok()?;
            Some(Key::ProtoPortIndex(p, port, i))
        }
        // Only an address paired with itself is modelled; anything else is foreign.
        KeyType::AddrPair if b.len() == 2 * alen && b[..alen] == b[alen..] => {
            Some(Key::AddrPair(decode_addr(&b[..alen])?))
        }
        _ => None,
    }
}

const NFTA_SET_ELEM_TIMEOUT: u16 = 4;
const NFTA_SET_ELEM_EXPIRATION: u16 = 5;
const NFTA_SET_ELEM_USERDATA: u16 = 6;

/// An interval bound of an endpoint map as the kernel lists it: `(value, Some(endpoint))` for a
/// start, `(value, None)` for an end.
type SlotBoundRaw = (u32, Option<(IpAddr, u16)>);

/// Adds the elements of the dump `msgs` to `out`; false if one cannot be decoded.
fn decode_elements(
    family: Family,
    decl: &SetDecl,
    msgs: &[Vec<u8>],
    out: &mut BTreeMap<Key, Option<Value>>,
) -> bool {
    if decl.key == KeyType::Slot {
        let mut bounds = Vec::new();
        if !walk_elements(msgs, |e| decode_slot_element(family, e, &mut bounds)) {
            return false;
        }
        // An interval is two elements, paired up once all are read.
        out.extend(
            slot_elements_from_bounds(bounds)
                .into_iter()
                .map(|(k, v)| (k, Some(v))),
        );
        return true;
    }
    walk_elements(msgs, |e| decode_element(family, decl, e, out))
}

/// Calls `f` on every element of the dump `msgs`; false if one is malformed or `f` says so.
fn walk_elements(msgs: &[Vec<u8>], mut f: impl FnMut(&[u8]) -> bool) -> bool {
    for m in msgs {
        let Some(attrs) = message_nlas(m) else {
            return false;
        };
        for (kind, list) in attrs {
            if kind != NFTA_SET_ELEM_LIST_ELEMENTS {
                continue;
            }
            let Some(elements) = nlas(list) else {
                return false;
            };
            for (kind, element) in elements {
                if kind != NFTA_LIST_ELEM || !f(element) {
                    return false;
                }
            }
        }
    }
    true
}

fn decode_element(
    family: Family,
    decl: &SetDecl,
    element: &[u8],
    out: &mut BTreeMap<Key, Option<Value>>,
) -> bool {
    let Some((key, value, false)) = raw_element(family, decl.key.holds_endpoints(), element) else {
        return false;
    };
    let Some(key) = decode_key(family, decl.key, &key) else {
        return false;
    };
    if (decl.is_vmap || decl.key.holds_endpoints()) != value.is_some() {
        return false;
    }
    out.insert(key, value);
    true
}

/// One element as the kernel lists it: its key's bytes, its data (an endpoint if `endpoints`,
/// else a verdict) and whether it ends an interval; `None` if it is malformed or has anything
/// else nftproxy does not write.
fn raw_element(
    family: Family,
    endpoints: bool,
    element: &[u8],
) -> Option<(Vec<u8>, Option<Value>, bool)> {
    let mut key = None;
    let mut value = None;
    let mut end = false;
    for (kind, v) in attr_map(element)? {
        match kind {
            NFTA_SET_ELEM_KEY => key = Some(data_value(v)?),
            NFTA_SET_ELEM_DATA if endpoints => {
                let (addr, port) = decode_endpoint(family, &data_value(v)?)?;
                value = Some(Value::Endpoint(addr, port));
            }
            NFTA_SET_ELEM_DATA => value = Some(Value::Verdict(data_verdict(v)?)),
            NFTA_SET_ELEM_FLAGS => match be_u32(v)? {
                0 => {}
                NFT_SET_ELEM_INTERVAL_END => end = true,
                _ => return None,
            },
            // Per-element timeouts, expirations, comments: nothing nftproxy compares.
            NFTA_SET_ELEM_TIMEOUT | NFTA_SET_ELEM_EXPIRATION | NFTA_SET_ELEM_USERDATA => {}
            _ => return None,
        }
    }
    Some((key?, value, end))
}

/// An endpoint as map data: the address, then the port padded to 4 bytes.
fn decode_endpoint(family: Family, b: &[u8]) -> Option<(IpAddr, u16)> {
    let alen = addr_layout(family).2 as usize;
    if b.len() != alen + 4 || b[alen + 2..] != [0, 0] {
        return None;
    }
    Some((
        decode_addr(&b[..alen])?,
        u16::from_be_bytes([b[alen], b[alen + 1]]),
    ))
}

/// One element of an endpoint map: a 4-byte big-endian key, and either the interval-end flag
/// or the endpoint as data (the address, the port padded to 4 bytes).
fn decode_slot_element(family: Family, element: &[u8], out: &mut Vec<SlotBoundRaw>) -> bool {
    let Some((key, value, end)) = raw_element(family, true, element) else {
        return false;
    };
    let Some(at) = be_u32(&key) else {
        return false;
    };
    let target = match value {
        Some(Value::Endpoint(addr, port)) => Some((addr, port)),
        Some(Value::Verdict(_)) => return false,
        None => None,
    };
    // A start carries its endpoint, an end nothing.
    if end == target.is_some() {
        return false;
    }
    out.push((at, target));
    true
}

// --- Rules. ---

/// A register as a 32-bit word index (`NFT_REG_1` = word 0, `NFT_REG32_05` = word 5): the kernel
/// dumps 16-byte register numbers where it can, whatever was sent.
/// Words stay below `u32::MAX - 8`, so that adding a register's width (at most 4 words) to one,
/// as decoding does, cannot overflow whatever a message says.
type Word = u32;
const VERDICT_REG: Word = u32::MAX - 8;

fn word(r: u32) -> Word {
    match r {
        0 => VERDICT_REG,
        n @ 1..=4 => (n - 1) * 4,
        n @ 8..=23 => n - 8,
        n => n.saturating_add(1000).min(VERDICT_REG - 8),
    }
}

/// An expression reduced to what decoding needs.
#[derive(Debug)]
enum Ex {
    Payload {
        dreg: Word,
        base: u32,
        offset: u32,
        len: u32,
    },
    Cmp {
        sreg: Word,
        op: u32,
        data: Vec<u8>,
    },
    Bitwise {
        sreg: Word,
        dreg: Word,
        len: u32,
        mask: Vec<u8>,
        xor: Vec<u8>,
    },
    MetaLoad {
        key: u32,
        dreg: Word,
    },
    MetaSet {
        key: u32,
        sreg: Word,
    },
    Lookup {
        set: String,
        sreg: Word,
        dreg: Option<Word>,
    },
    ImmValue {
        dreg: Word,
        data: Vec<u8>,
    },
    ImmVerdict(Verdict),
    Other {
        name: String,
        attrs: BTreeMap<u16, Vec<u8>>,
    },
}

const NLA_TYPE_MASK: u16 = 0x3fff;
const NFTA_EXPR_NAME: u16 = 1;
const NFTA_EXPR_DATA: u16 = 2;

/// One `NFTA_LIST_ELEM` of a rule's expressions, reduced to what decoding needs.
fn raw_expr(elem: &[u8]) -> Option<Ex> {
    let e = attr_map(elem)?;
    if !e
        .keys()
        .all(|k| [NFTA_EXPR_NAME, NFTA_EXPR_DATA].contains(k))
    {
        return None;
    }
    let name = c_string(e.get(&NFTA_EXPR_NAME)?)?;
    let a = match e.get(&NFTA_EXPR_DATA) {
        Some(d) => attr_map(d)?,
        None => Attrs::new(),
    };
    let u = |k: u16| be_u32(a.get(&k)?);
    let reg = |k: u16| u(k).map(word);
    let allowed = |ks: &[u16]| a.keys().all(|k| ks.contains(k));
    // Attribute numbers from the kernel's nf_tables.h, per expression.
    Some(match name.as_str() {
        // NFTA_PAYLOAD_DREG, _BASE, _OFFSET, _LEN (no SREG/checksum: we only load).
        "payload" if allowed(&[1, 2, 3, 4]) => Ex::Payload {
            dreg: reg(1)?,
            base: u(2)?,
            offset: u(3)?,
            len: u(4)?,
        },
        // NFTA_CMP_SREG, _OP, _DATA.
        "cmp" if allowed(&[1, 2, 3]) => Ex::Cmp {
            sreg: reg(1)?,
            op: u(2)?,
            data: data_value(a.get(&3)?)?,
        },
        // NFTA_BITWISE_SREG, _DREG, _LEN, _MASK, _XOR, _OP (NFT_BITWISE_BOOL only).
        "bitwise" if allowed(&[1, 2, 3, 4, 5, 6]) && u(6).unwrap_or(0) == 0 => Ex::Bitwise {
            sreg: reg(1)?,
            dreg: reg(2)?,
            len: u(3)?,
            mask: data_value(a.get(&4)?)?,
            xor: data_value(a.get(&5)?)?,
        },
        // NFTA_META_DREG, _KEY, _SREG.
        "meta" if allowed(&[1, 2]) => Ex::MetaLoad {
            key: u(2)?,
            dreg: reg(1)?,
        },
        "meta" if allowed(&[2, 3]) => Ex::MetaSet {
            key: u(2)?,
            sreg: reg(3)?,
        },
        // NFTA_LOOKUP_SET, _SREG, _DREG, _SET_ID, _FLAGS (no inversion).
        "lookup" if allowed(&[1, 2, 3, 4, 5]) && u(5).unwrap_or(0) == 0 => Ex::Lookup {
            set: c_string(a.get(&1)?)?,
            sreg: reg(2)?,
            dreg: if a.contains_key(&3) {
                Some(reg(3)?)
            } else {
                None
            },
        },
        // NFTA_IMMEDIATE_DREG, _DATA.
        "immediate" if allowed(&[1, 2]) => match reg(1)? {
            VERDICT_REG => Ex::ImmVerdict(data_verdict(a.get(&2)?)?),
            dreg => Ex::ImmValue {
                dreg,
                data: data_value(a.get(&2)?)?,
            },
        },
        "payload" | "cmp" | "bitwise" | "meta" | "lookup" | "immediate" => return None,
        _ => Ex::Other {
            name,
            attrs: a.into_iter().map(|(k, v)| (k, v.to_vec())).collect(),
        },
    })
}

/// Attribute `k` of an untyped expression as a big-endian u32.
fn get_u32(attrs: &BTreeMap<u16, Vec<u8>>, k: u16) -> Option<u32> {
    Some(u32::from_be_bytes(
        attrs.get(&k)?.as_slice().try_into().ok()?,
    ))
}

/// The attributes of an untyped expression are exactly `allowed` (a subset of it).
fn only(attrs: &BTreeMap<u16, Vec<u8>>, allowed: &[u16]) -> bool {
    attrs.keys().all(|k| allowed.contains(k))
}

/// An optional u32 attribute is absent or `value`.
fn absent_or(attrs: &BTreeMap<u16, Vec<u8>>, k: u16, value: u32) -> bool {
    !attrs.contains_key(&k) || get_u32(attrs, k) == Some(value)
}

fn is_other<'a>(e: &'a Ex, expr: &str) -> Option<&'a BTreeMap<u16, Vec<u8>>> {
    match e {
        Ex::Other { name, attrs } if name == expr => Some(attrs),
        _ => None,
    }
}

fn reg_of(attrs: &BTreeMap<u16, Vec<u8>>, k: u16) -> Option<Word> {
    Some(word(get_u32(attrs, k)?))
}

const META_L4PROTO: u32 = 16;
const META_MARK: u32 = 3;
const META_IIFNAME: u32 = 6;
const CMP_EQ: u32 = 0;
const CMP_NEQ: u32 = 1;

fn u32_ne(b: &[u8]) -> Option<u32> {
    Some(u32::from_ne_bytes(b.try_into().ok()?))
}

/// Prefix length of a network mask, if it is one.
fn prefix_of(mask: &[u8]) -> Option<u8> {
    let bits: u32 = mask.iter().map(|b| b.count_ones()).sum();
    let ones = mask
        .iter()
        .flat_map(|b| (0..8).rev().map(move |i| (b >> i) & 1))
        .take_while(|&b| b == 1)
        .count() as u32;
    (bits == ones).then_some(ones as u8)
}

fn decode_match(family: Family, ex: &[Ex]) -> Option<(Match, usize)> {
    let (saddr_off, daddr_off, alen) = addr_layout(family);
    if let Some((n, next)) = frontend_load(family, ex)
        && let Some(Ex::Lookup {
            set,
            sreg: 0,
            dreg: None,
        }) = ex.get(n)
    {
        let set = set.clone();
        let m = if next == 2 {
            Match::ProtoPortInSet { set }
        } else {
            Match::AddrProtoPortInSet { set }
        };
        return Some((m, n + 1));
    }
    match ex {
        [
            Ex::Other { name, attrs },
            Ex::Bitwise {
                sreg,
                dreg,
                len: 4,
                mask,
                xor,
            },
            Ex::Cmp {
                sreg: cs,
                op: CMP_NEQ,
                data,
            },
            ..,
        ] if name == "ct"
            && only(attrs, &[NFTA_CT_DREG, NFTA_CT_KEY])
            && get_u32(attrs, NFTA_CT_KEY) == Some(NFT_CT_STATE)
            && reg_of(attrs, NFTA_CT_DREG) == Some(*sreg)
            && sreg == dreg
            && dreg == cs
            && u32_ne(mask) == Some(CT_STATE_NEW_BIT)
            && xor == &[0; 4]
            && data == &[0; 4] =>
        {
            Some((Match::CtStateNew, 3))
        }
        [
            Ex::Other { name, attrs },
            Ex::Bitwise {
                sreg,
                dreg,
                len: 4,
                mask,
                xor,
            },
            Ex::Cmp {
                sreg: cs,
                op: CMP_NEQ,
                data,
            },
            ..,
        ] if name == "ct"
            && only(attrs, &[NFTA_CT_DREG, NFTA_CT_KEY])
            && get_u32(attrs, NFTA_CT_KEY) == Some(NFT_CT_STATUS)
            && reg_of(attrs, NFTA_CT_DREG) == Some(*sreg)
            && sreg == dreg
            && dreg == cs
            && u32_ne(mask) == Some(CT_STATUS_DNAT_BIT)
            && xor == &[0; 4]
            && data == &[0; 4] =>
        {
            Some((Match::CtStatusDnat, 3))
        }
        [
            Ex::Payload {
                dreg: first,
                base: NFT_PAYLOAD_NETWORK_HEADER,
                offset: so,
                len: sl,
            },
            Ex::Payload {
                dreg: second,
                base: NFT_PAYLOAD_NETWORK_HEADER,
                offset: d_o,
                len: dl,
            },
            Ex::Lookup {
                set,
                sreg,
                dreg: None,
            },
            ..,
        ] if *so == saddr_off
            && *d_o == daddr_off
            && *sl == alen
            && *dl == alen
            && *second == *first + alen / 4
            && sreg == first =>
        {
            Some((Match::SaddrDaddrInSet { set: set.clone() }, 3))
        }
        [
            Ex::Payload {
                dreg,
                base,
                offset,
                len,
            },
            rest @ ..,
        ] if *base == NFT_PAYLOAD_NETWORK_HEADER
            && *len == alen
            && (*offset == saddr_off || *offset == daddr_off) =>
        {
            let dest = *offset == daddr_off;
            match rest {
                [
                    Ex::Lookup {
                        set,
                        sreg,
                        dreg: None,
                    },
                    ..,
                ] if sreg == dreg => {
                    let set = set.clone();
                    let m = if dest {
                        Match::DaddrInSet { set }
                    } else {
                        Match::SaddrInSet { set }
                    };
                    Some((m, 2))
                }
                [
                    Ex::Bitwise {
                        sreg,
                        dreg: bd,
                        len: blen,
                        mask,
                        xor,
                    },
                    Ex::Cmp { sreg: cs, op, data },
                    ..,
                ] if sreg == dreg
                    && bd == dreg
                    && cs == dreg
                    && *blen == alen
                    && xor.iter().all(|&b| b == 0) =>
                {
                    let prefix = prefix_of(mask)?;
                    let net = IpNet::new(decode_addr(data)?, prefix).ok()?;
                    if net.trunc() != net {
                        return None;
                    }
                    Some((addr_match(dest, net, *op)?, 3))
                }
                [Ex::Cmp { sreg, op, data }, ..] if sreg == dreg => {
                    let addr = decode_addr(data)?;
                    let net = IpNet::new(addr, (alen * 8) as u8).ok()?;
                    Some((addr_match(dest, net, *op)?, 2))
                }
                _ => None,
            }
        }
        [
            Ex::Other { name, attrs },
            Ex::Cmp {
                sreg,
                op: CMP_EQ,
                data,
            },
            ..,
        ] if name == "fib" => {
            if !only(attrs, &[NFTA_FIB_DREG, NFTA_FIB_RESULT, NFTA_FIB_FLAGS])
                || reg_of(attrs, NFTA_FIB_DREG) != Some(*sreg)
                || get_u32(attrs, NFTA_FIB_RESULT) != Some(NFT_FIB_RESULT_ADDRTYPE)
                || u32_ne(data) != Some(RTN_LOCAL)
            {
                return None;
            }
            match get_u32(attrs, NFTA_FIB_FLAGS)? {
                NFTA_FIB_F_SADDR => Some((Match::FibSaddrLocal, 2)),
                NFTA_FIB_F_DADDR => Some((Match::FibDaddrLocal, 2)),
                _ => None,
            }
        }
        [
            Ex::Other { name, attrs },
            Ex::Cmp {
                sreg,
                op: CMP_EQ,
                data,
            },
            ..,
        ] if name == "numgen" => {
            let (dreg, modulus, offset) = random_numgen(attrs)?;
            if dreg != *sreg || offset != 0 {
                return None;
            }
            let value = u32_ne(data)?;
            Some((Match::Numgen { modulus, value }, 2))
        }
        [
            Ex::MetaLoad { key, dreg },
            Ex::Cmp {
                sreg,
                op: CMP_EQ,
                data,
            },
            ..,
        ] if *key == META_L4PROTO && sreg == dreg && data.len() == 1 => {
            Some((Match::L4Proto(Proto::from_number(data[0])?), 2))
        }
        [
            Ex::MetaLoad { key, dreg },
            Ex::Bitwise {
                sreg,
                dreg: bd,
                len: 4,
                mask,
                xor,
            },
            Ex::Cmp {
                sreg: cs,
                op: CMP_EQ,
                data,
            },
            ..,
        ] if *key == META_MARK
            && sreg == dreg
            && bd == dreg
            && cs == dreg
            && xor == &[0; 4]
            && data == &[0; 4] =>
        {
            Some((
                Match::MarkUnset {
                    mask: u32_ne(mask)?,
                },
                3,
            ))
        }
        [Ex::MetaLoad { key, dreg }, Ex::Cmp { sreg, op, data }, ..]
            if *key == META_IIFNAME && sreg == dreg =>
        {
            let negate = match *op {
                CMP_EQ => false,
                CMP_NEQ => true,
                _ => return None,
            };
            let (name, prefix) = match data.iter().position(|&b| b == 0) {
                // An exact name is the NUL-padded IFNAMSIZ buffer.
                Some(end) if data.len() == 16 && data[end..].iter().all(|&b| b == 0) => {
                    (&data[..end], false)
                }
                None if !data.is_empty() => (&data[..], true),
                _ => return None,
            };
            let name = String::from_utf8(name.to_vec()).ok()?;
            Some((
                Match::IifName {
                    name,
                    prefix,
                    negate,
                },
                2,
            ))
        }
        _ => None,
    }
}

fn addr_match(dest: bool, net: IpNet, op: u32) -> Option<Match> {
    let negate = match op {
        CMP_EQ => false,
        CMP_NEQ => true,
        _ => return None,
    };
    Some(if dest {
        Match::Daddr { net, negate }
    } else {
        Match::Saddr { net, negate }
    })
}

fn decode_action(family: Family, ex: &[Ex]) -> Option<Action> {
    let (saddr_off, _, alen) = addr_layout(family);
    if let Some(action) = frontend_action(family, ex) {
        return Some(action);
    }
    let reject_code = match family {
        Family::V4 => ICMP_PORT_UNREACH,
        Family::V6 => ICMPV6_PORT_UNREACH,
    };
    match ex {
        [Ex::ImmVerdict(v)] => Some(Action::Verdict(v.clone())),
        [e] if is_other(e, "reject").is_some() => {
            let attrs = is_other(e, "reject")?;
            (only(attrs, &[NFTA_REJECT_TYPE, NFTA_REJECT_ICMP_CODE])
                && get_u32(attrs, NFTA_REJECT_TYPE) == Some(NFT_REJECT_ICMP_UNREACH)
                && attrs.get(&NFTA_REJECT_ICMP_CODE).map(Vec::as_slice) == Some(&[reject_code][..]))
            .then_some(Action::Reject)
        }
        [e] if is_other(e, "masq").is_some() => {
            let attrs = is_other(e, "masq")?;
            (only(attrs, &[NFTA_MASQ_FLAGS])
                && get_u32(attrs, NFTA_MASQ_FLAGS) == Some(NF_NAT_RANGE_PROTO_RANDOM_FULLY))
            .then_some(Action::Masquerade)
        }
        [
            Ex::ImmValue {
                dreg: ra,
                data: addr,
            },
            Ex::ImmValue {
                dreg: rp,
                data: port,
            },
            e,
        ] => {
            let ok = dnat_regs(family, is_other(e, "nat")?) == Some((*ra, *rp))
                && addr.len() == alen as usize
                && port.len() == 2;
            // Not `then_some`: its argument, which indexes `port`, is evaluated either way.
            ok.then(|| {
                Some(Action::Dnat {
                    addr: decode_addr(addr)?,
                    port: u16::from_be_bytes([port[0], port[1]]),
                })
            })?
        }
        [
            Ex::Other { name, attrs: ng },
            Ex::Other {
                name: bo_name,
                attrs: bo,
            },
            Ex::Lookup {
                set,
                sreg,
                dreg: Some(data),
            },
            e,
        ] if name == "numgen" && bo_name == "byteorder" => {
            let (value, modulus, offset) = random_numgen(ng)?;
            let ok = modulus == SLOT_MODULUS
                && only(
                    bo,
                    &[
                        NFTA_BYTEORDER_SREG,
                        NFTA_BYTEORDER_DREG,
                        NFTA_BYTEORDER_OP,
                        NFTA_BYTEORDER_LEN,
                        NFTA_BYTEORDER_SIZE,
                    ],
                )
                && reg_of(bo, NFTA_BYTEORDER_SREG) == Some(value)
                && reg_of(bo, NFTA_BYTEORDER_DREG) == Some(value)
                && get_u32(bo, NFTA_BYTEORDER_OP) == Some(NFT_BYTEORDER_HTON)
                && get_u32(bo, NFTA_BYTEORDER_LEN) == Some(4)
                && get_u32(bo, NFTA_BYTEORDER_SIZE) == Some(4)
                && *sreg == value
                // The endpoint's port follows its address.
                && dnat_regs(family, is_other(e, "nat")?) == Some((*data, data + alen / 4));
            ok.then_some(Action::DnatSlot {
                map: endpoint_map_name(endpoint_map_index(set)?),
                offset,
            })
        }
        [
            Ex::MetaLoad { key, dreg },
            Ex::Bitwise {
                sreg,
                dreg: bd,
                len: 4,
                mask,
                xor,
            },
            Ex::MetaSet { key: sk, sreg: ss },
        ] if *key == META_MARK && *sk == META_MARK && sreg == dreg && bd == dreg && ss == dreg => {
            let (mask, bits) = (u32_ne(mask)?, u32_ne(xor)?);
            if mask == u32::MAX {
                Some(Action::MarkXor(bits))
            } else if mask == !bits {
                Some(Action::MarkOr(bits))
            } else {
                None
            }
        }
        [
            Ex::Payload {
                dreg,
                base: NFT_PAYLOAD_NETWORK_HEADER,
                offset,
                len,
            },
            e,
        ] if *offset == saddr_off && *len == alen => {
            let attrs = is_other(e, "dynset")?;
            let set = attrs.get(&NFTA_DYNSET_SET_NAME)?;
            let end = set.iter().position(|&b| b == 0).unwrap_or(set.len());
            let ok = only(
                attrs,
                &[
                    NFTA_DYNSET_SET_NAME,
                    NFTA_DYNSET_OP,
                    NFTA_DYNSET_SREG_KEY,
                    NFTA_DYNSET_TIMEOUT,
                    NFTA_DYNSET_FLAGS,
                ],
            ) && get_u32(attrs, NFTA_DYNSET_OP) == Some(NFT_DYNSET_OP_UPDATE)
                && reg_of(attrs, NFTA_DYNSET_SREG_KEY) == Some(*dreg)
                && !attrs.contains_key(&NFTA_DYNSET_SREG_DATA)
                && attrs
                    .get(&NFTA_DYNSET_TIMEOUT)
                    .is_none_or(|t| t.iter().all(|&b| b == 0))
                && absent_or(attrs, NFTA_DYNSET_FLAGS, 0);
            ok.then_some(Action::UpdateSaddr {
                set: String::from_utf8(set[..end].to_vec()).ok()?,
            })
        }
        _ => None,
    }
}

/// The actions keyed by a Service frontend: a verdict-map dispatch, or a DNAT through an
/// endpoint list.
fn frontend_action(family: Family, ex: &[Ex]) -> Option<Action> {
    let (n, next) = frontend_load(family, ex)?;
    let nodeport = next == 2;
    match &ex[n..] {
        [
            Ex::Lookup {
                set,
                sreg: 0,
                dreg: Some(VERDICT_REG),
            },
        ] => {
            let map = set.clone();
            Some(if nodeport {
                Action::VmapProtoPort { map }
            } else {
                Action::VmapAddrProtoPort { map }
            })
        }
        [
            Ex::Other { name, attrs: ng },
            Ex::Lookup {
                set,
                sreg: 0,
                dreg: Some(data),
            },
            e,
        ] if name == "numgen" => {
            // The kernel lists the offset, 0, although none was sent.
            let (dreg, modulus, offset) = random_numgen(ng)?;
            let alen = addr_layout(family).2;
            let ok = dreg == next
                && offset == 0
                && modulus > 0
                && dnat_regs(family, is_other(e, "nat")?) == Some((*data, data + alen / 4));
            ok.then_some(Action::DnatIndexed {
                map: set.clone(),
                nodeport,
                modulus,
            })
        }
        _ => None,
    }
}

/// A `numgen random` expression's destination register, modulus and offset (0 if absent).
fn random_numgen(attrs: &BTreeMap<u16, Vec<u8>>) -> Option<(Word, u32, u32)> {
    let ok = only(
        attrs,
        &[NFTA_NG_DREG, NFTA_NG_MODULUS, NFTA_NG_TYPE, NFTA_NG_OFFSET],
    ) && get_u32(attrs, NFTA_NG_TYPE) == Some(NFT_NG_RANDOM);
    let offset = match attrs.contains_key(&NFTA_NG_OFFSET) {
        true => get_u32(attrs, NFTA_NG_OFFSET)?,
        false => 0,
    };
    ok.then_some((
        reg_of(attrs, NFTA_NG_DREG)?,
        get_u32(attrs, NFTA_NG_MODULUS)?,
        offset,
    ))
}

/// `[ip daddr .] meta l4proto . th dport` loaded into consecutive words from word 0: the
/// number of expressions and the word after the last (2 without the address).
fn frontend_load(family: Family, ex: &[Ex]) -> Option<(usize, Word)> {
    let (_, daddr_off, alen) = addr_layout(family);
    let (skip, first, word) = match ex.first()? {
        Ex::Payload {
            dreg,
            base: NFT_PAYLOAD_NETWORK_HEADER,
            offset,
            len,
        } if *offset == daddr_off && *len == alen => (1, *dreg, *dreg + alen / 4),
        _ => (0, 0, 0),
    };
    match ex.get(skip..skip + 2)? {
        [
            Ex::MetaLoad { key, dreg: p },
            Ex::Payload {
                dreg: d,
                base: NFT_PAYLOAD_TRANSPORT_HEADER,
                offset: 2,
                len: 2,
            },
        ] if *key == META_L4PROTO && *p == word && *d == word + 1 && first == 0 => {
            Some((skip + 2, word + 2))
        }
        _ => None,
    }
}

/// The address and port registers of a `nat` expression that is a `dnat` of `family` to one
/// address and port.
fn dnat_regs(family: Family, attrs: &BTreeMap<u16, Vec<u8>>) -> Option<(Word, Word)> {
    let addr_min = reg_of(attrs, NFTA_NAT_REG_ADDR_MIN)?;
    let proto_min = reg_of(attrs, NFTA_NAT_REG_PROTO_MIN)?;
    let ok = only(
        attrs,
        &[
            NFTA_NAT_TYPE,
            NFTA_NAT_FAMILY,
            NFTA_NAT_REG_ADDR_MIN,
            NFTA_NAT_REG_ADDR_MAX,
            NFTA_NAT_REG_PROTO_MIN,
            NFTA_NAT_REG_PROTO_MAX,
            NFTA_NAT_FLAGS,
        ],
    ) && get_u32(attrs, NFTA_NAT_TYPE) == Some(NFT_NAT_DNAT)
        && get_u32(attrs, NFTA_NAT_FAMILY) == Some(u8::from(nfproto(family)).into())
        && attrs
            .get(&NFTA_NAT_REG_ADDR_MAX)
            .is_none_or(|_| reg_of(attrs, NFTA_NAT_REG_ADDR_MAX) == Some(addr_min))
        && attrs
            .get(&NFTA_NAT_REG_PROTO_MAX)
            .is_none_or(|_| reg_of(attrs, NFTA_NAT_REG_PROTO_MAX) == Some(proto_min))
        // The kernel adds NF_NAT_RANGE_MAP_IPS and PROTO_SPECIFIED itself.
        && get_u32(attrs, NFTA_NAT_FLAGS).unwrap_or(0)
            & !(NF_NAT_RANGE_MAP_IPS | NF_NAT_RANGE_PROTO_SPECIFIED)
            == 0;
    ok.then_some((addr_min, proto_min))
}

/// Decodes a rule's `NFTA_RULE_EXPRESSIONS` back into the ruleset model; `None` for anything
/// nftproxy does not write.
fn decode_rule(family: Family, exprs: &[u8], comment: Option<String>) -> Option<Rule> {
    let ex = nlas(exprs)?
        .into_iter()
        .map(|(kind, e)| {
            if kind == NFTA_LIST_ELEM {
                raw_expr(e)
            } else {
                None
            }
        })
        .collect::<Option<Vec<Ex>>>()?;
    let mut matches = Vec::new();
    let mut i = 0;
    loop {
        if let Some(action) = decode_action(family, &ex[i..]) {
            return Some(Rule {
                matches,
                action,
                comment,
            });
        }
        let (m, n) = decode_match(family, &ex[i..])?;
        matches.push(m);
        i += n;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dataplane::nft::ruleset::{Proto, slot_offset};
    use netlink_packet_core::Emitable;
    use netlink_packet_netfilter::nftables::MetaKey;

    /// A notification: nf_tables message `msg` of family `family` with table-name attribute
    /// `table` (or, for `NEWGEN`, generation id `generation`).
    fn notification(msg: u16, family: u8, table: &str, generation: u32) -> Vec<u8> {
        let payload = if msg == NFT_MSG_NEWGEN {
            generation.to_be_bytes().to_vec()
        } else {
            [table.as_bytes(), &[0]].concat()
        };
        let mut attr = Vec::new();
        attr.extend(((4 + payload.len()) as u16).to_ne_bytes());
        attr.extend(1u16.to_ne_bytes());
        attr.extend(&payload);
        while attr.len() % 4 != 0 {
            attr.push(0);
        }
        let mut m = Vec::new();
        m.extend(((20 + attr.len()) as u32).to_ne_bytes());
        m.extend(((NFNL_SUBSYS_NFTABLES << 8) | msg).to_ne_bytes());
        m.extend([0u8; 10]);
        m.extend([family, 0, 0, 0]);
        m.extend(attr);
        m
    }

    #[test]
    fn notifications_say_whether_our_table_or_the_chain_list_changed() {
        const NEWSETELEM: u16 = 12;
        let v4 = NFPROTO_IPV4;
        // Another table's elements, then a commit: nothing for us.
        let mut c = Changes::default();
        c.take_in(
            &[
                notification(NEWSETELEM, v4, "other", 0),
                notification(NFT_MSG_NEWGEN, 0, "", 41),
            ]
            .concat(),
            v4,
        );
        assert_eq!(
            c,
            Changes {
                last_gen: Some(41),
                commits: 1,
                ..Changes::default()
            }
        );
        assert!(c.seen(40) && c.seen(41) && !c.seen(42));
        // Chains of another ip table come and go: only the chain list moved.
        c.take_in(&notification(NFT_MSG_DELCHAIN, v4, "other", 0), v4);
        assert!(c.chains_moved && !c.ours);
        // Our table, but in the other family: not ours.
        c.take_in(&notification(NEWSETELEM, NFPROTO_IPV6, TABLE, 0), v4);
        assert!(!c.ours);
        c.take_in(&notification(NEWSETELEM, v4, TABLE, 0), v4);
        assert!(c.ours && !c.overflow);
        // Garbage is a loss.
        c.take_in(
            &[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17],
            v4,
        );
        assert!(c.overflow);
        // Generation ids wrap around.
        let c = Changes {
            last_gen: Some(2),
            ..Changes::default()
        };
        assert!(c.seen(u32::MAX) && c.seen(2) && !c.seen(3));
    }

    /// Every Match and Action survives encode → decode (the kernel-side round trip, register
    /// renumbering included, is covered by the kernel tests).
    #[test]
    fn rules_round_trip_through_the_encoder() {
        for family in Family::ALL {
            let (net, host, addr): (IpNet, IpNet, IpAddr) = match family {
                Family::V4 => (
                    "10.0.0.0/8".parse().unwrap(),
                    "10.1.2.3/32".parse().unwrap(),
                    "10.9.9.9".parse().unwrap(),
                ),
                Family::V6 => (
                    "fd00::/12".parse().unwrap(),
                    "fd00::1/128".parse().unwrap(),
                    "fd00::9".parse().unwrap(),
                ),
            };
            let matches = vec![
                Match::CtStateNew,
                Match::Daddr {
                    net: host,
                    negate: false,
                },
                Match::Saddr { net, negate: true },
                Match::DaddrInSet { set: "s".into() },
                Match::SaddrInSet { set: "s".into() },
                Match::CtStatusDnat,
                Match::SaddrDaddrInSet {
                    set: "pairs".into(),
                },
                Match::AddrProtoPortInSet {
                    set: "frontends".into(),
                },
                Match::ProtoPortInSet {
                    set: "nodeports".into(),
                },
                Match::FibSaddrLocal,
                Match::FibDaddrLocal,
                Match::L4Proto(Proto::Sctp),
                Match::Numgen {
                    modulus: 3,
                    value: 2,
                },
                Match::MarkUnset { mask: 0x4000 },
                Match::IifName {
                    name: "eth0".into(),
                    prefix: false,
                    negate: false,
                },
                Match::IifName {
                    name: "veth".into(),
                    prefix: true,
                    negate: true,
                },
            ];
            let actions = vec![
                Action::Verdict(Verdict::Accept),
                Action::Verdict(Verdict::Drop),
                Action::Verdict(Verdict::Return),
                Action::Verdict(Verdict::Jump("c".into())),
                Action::Verdict(Verdict::Goto("c".into())),
                Action::VmapAddrProtoPort { map: "m".into() },
                Action::VmapProtoPort { map: "m".into() },
                Action::Reject,
                Action::Dnat { addr, port: 8080 },
                Action::Masquerade,
                Action::MarkOr(0x4000),
                Action::MarkXor(0x4000),
                Action::UpdateSaddr { set: "aff".into() },
                Action::DnatSlot {
                    map: endpoint_map_name(17),
                    offset: slot_offset(3),
                },
                Action::DnatSlot {
                    map: endpoint_map_name(0),
                    offset: 0,
                },
                Action::DnatIndexed {
                    map: "cluster-endpoints-3".into(),
                    nodeport: false,
                    modulus: 3,
                },
                Action::DnatIndexed {
                    map: "local-nodeport-endpoints-1".into(),
                    nodeport: true,
                    modulus: 1,
                },
            ];
            for action in actions {
                let rule = Rule::new(matches.clone(), action).with_comment("c");
                let attr = RuleAttribute::Expressions(rule_exprs(family, &rule).unwrap());
                let mut buf = vec![0; attr.buffer_len()];
                attr.emit(&mut buf);
                let back = decode_rule(family, &buf[4..], rule.comment.clone());
                assert_eq!(back.as_ref(), Some(&rule), "{family:?}");
            }
        }
    }

    #[test]
    fn meta_key_numbers() {
        assert_eq!(u32::from(MetaKey::L4Proto), META_L4PROTO);
        assert_eq!(u32::from(MetaKey::Mark), META_MARK);
        assert_eq!(u32::from(MetaKey::Iifname), META_IIFNAME);
    }
}
