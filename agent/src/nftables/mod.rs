//! The kernel backend: sends the planner's transactions to nf_tables over netlink and reads
//! table `nftproxy` back.
//!
//! # Netns
//! A netlink socket belongs to the network namespace of the thread that opened it. Open
//! [`Nftables`] on a thread that is already in the target namespace; it keeps working there.
//!
//! # Transactions
//! [`Nftables::apply`] sends one [`Transaction`] as a single `NFNL_MSG_BATCH_BEGIN .. END` batch
//! in one `send()`: the kernel commits all of it or nothing. Only the last command asks for an
//! ACK; the kernel reports every failing message with its sequence number, which maps back to
//! the [`Op`] that produced it ([`NftError::Op`]).
//!
//! # Reading back
//! [`Nftables::read_table`] dumps the chains, rules, sets and elements of the table and turns
//! them into the planner's [`TableState`]:
//! * **Chain fingerprints are computed from the rules the kernel holds**, decoded back into the
//!   ruleset model, not read from the chain comment. The kernel ignores a new comment when an
//!   existing chain is re-added (checked on 6.18), so after an in-place rewrite the comment
//!   still carries the old fingerprint. The human part of the comment (before ` [fingerprint]`)
//!   is taken from the comment. A chain with a rule that nftproxy does not write, or without a
//!   fingerprint comment, gets `fingerprint: None` and is rewritten by the planner.
//! * A base chain whose hook, type or policy nftproxy does not use is reported with priority
//!   `i32::MIN`, so that it never equals a desired chain and the planner recreates it.
//! * Sets whose declaration cannot be decoded (foreign key types, flags or elements) are
//!   reported with [`UNDECODABLE_SET_COMMENT`] as comment and no elements, so that they never
//!   equal a desired declaration and the planner recreates or deletes them. Anonymous sets
//!   belong to their rule and are left out.
//! * Elements of dynamic (`timeout`) sets are not read: the datapath adds them, the planner
//!   never does, and reporting them would make the planner delete them.
//! * **Other programs' commits do not disturb a read.** Every dump but the chain dump is
//!   filtered to the table in the kernel; a read listens to the change notifications while it
//!   runs and starts again (after a short backoff) only when a commit touched table
//!   `nftproxy`, so a program committing to its own table every millisecond costs nothing.
//!   See `dump::read_table`.

mod affinity;
mod dump;
mod encode;
pub mod fake;
pub mod kernel;
mod listeners;
pub mod monitor;
mod socket;

use std::io;
use std::sync::mpsc;

use dataplane::nft::render;
use dataplane::nft::ruleset::{Family, TABLE};
use dataplane::nft::state::TableState;
use dataplane::nft::transaction::{Op, Transaction};
use netlink_packet_core::{NLM_F_ACK, NLM_F_DUMP, NLM_F_DUMP_INTR};
use netlink_packet_netfilter::NetfilterHeader;
use netlink_packet_netfilter::nftables::{NfTablesMessage, TableAttribute, TableMessage};

use self::socket::{NLMSG_DONE, NLMSG_ERROR, NlSocket};

pub use self::dump::{ReadStats, UNDECODABLE_SET_COMMENT};
#[doc(hidden)]
pub use self::{dump::decode_state, encode::transaction_messages, socket::datagram_replies};

/// What went wrong talking to nf_tables.
#[derive(Debug, thiserror::Error)]
pub enum NftError {
    /// The socket itself failed.
    #[error("netlink {context}: {source}")]
    Io {
        context: &'static str,
        #[source]
        source: io::Error,
    },
    /// The kernel rejected operation `index` of the transaction; nothing was committed.
    /// `also_failed` counts the other messages of the batch the kernel rejected too (often
    /// consequences of the first).
    #[error("nftables rejected operation {index} `{op}`: {source}")]
    Op {
        index: usize,
        /// The operation as an nft command (see `render::transaction_text`), possibly shortened.
        op: String,
        /// The operation itself, to tell which Service it belongs to.
        refused: Box<Op>,
        errno: i32,
        also_failed: usize,
        #[source]
        source: io::Error,
    },
    /// The kernel rejected the transaction as a whole (e.g. at commit); nothing was committed.
    #[error("nftables rejected the transaction: {source}")]
    Batch {
        errno: i32,
        #[source]
        source: io::Error,
    },
    /// Operation `index` cannot be expressed as a netlink message; nothing was sent.
    #[error("cannot encode operation {index} `{op}`: {reason}")]
    Encode {
        index: usize,
        op: String,
        /// The operation, or the part of it that cannot be encoded.
        refused: Box<Op>,
        reason: String,
    },
    /// A request to read state failed.
    #[error("nftables {request} failed: {source}")]
    Request {
        request: &'static str,
        errno: i32,
        #[source]
        source: io::Error,
    },
    /// A reply could not be parsed.
    #[error("cannot decode the reply to {request}: {reason}")]
    Decode {
        request: &'static str,
        reason: String,
    },
}

impl NftError {
    /// The kernel's errno, if the kernel reported one.
    pub fn errno(&self) -> Option<i32> {
        match self {
            NftError::Op { errno, .. }
            | NftError::Batch { errno, .. }
            | NftError::Request { errno, .. } => Some(*errno),
            NftError::Io { source, .. } => source.raw_os_error(),
            NftError::Encode { .. } | NftError::Decode { .. } => None,
        }
    }

    /// The index of the operation that caused the error, if one did.
    pub fn op_index(&self) -> Option<usize> {
        match self {
            NftError::Op { index, .. } | NftError::Encode { index, .. } => Some(*index),
            _ => None,
        }
    }

    /// The operation (or the part of it) the kernel or the encoder refused, if one was.
    pub fn refused_op(&self) -> Option<&Op> {
        match self {
            NftError::Op { refused, .. } | NftError::Encode { refused, .. } => Some(refused),
            _ => None,
        }
    }

    fn io(context: &'static str) -> impl FnOnce(io::Error) -> NftError {
        move |source| NftError::Io { context, source }
    }
}

/// What one [`Nftables::apply`] sent.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ApplyStats {
    /// Netlink messages, `BATCH_BEGIN` and `BATCH_END` included.
    pub messages: usize,
    /// Bytes sent.
    pub bytes: usize,
}

/// A connection to nf_tables in the network namespace of the thread that opened it.
pub struct Nftables {
    sock: NlSocket,
    /// Next sequence number. Every request uses fresh numbers, so replies to an earlier request
    /// that are still queued are recognised and skipped.
    seq: u32,
    /// Batches the kernel committed for us; each one moved the ruleset generation on by one.
    commits: u64,
    /// How the last read of the table went.
    last_read: ReadStats,
    /// Change notifications for reads; `None` if the socket could not be opened (then any
    /// commit during a read makes it start again).
    notes: Option<socket::Notifications>,
}

impl std::fmt::Debug for Nftables {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Nftables")
            .field("seq", &self.seq)
            .finish_non_exhaustive()
    }
}

/// Longest op description kept in an error.
const MAX_OP_TEXT: usize = 300;

/// One op as an nft command, for error messages.
fn describe_op(family: Family, op: &Op) -> String {
    let tx = Transaction {
        family,
        ops: vec![op.clone()],
    };
    let text = render::transaction_text(&tx);
    let text = text.trim_end();
    if text.len() <= MAX_OP_TEXT {
        return text.to_string();
    }
    let mut cut = MAX_OP_TEXT;
    while !text.is_char_boundary(cut) {
        cut -= 1;
    }
    format!("{}…", &text[..cut])
}

/// Replies to one request, or the errno the kernel answered it with.
pub(super) enum Reply {
    Messages {
        /// Each reply message, netlink header included.
        messages: Vec<Vec<u8>>,
        /// The kernel flagged the dump as interrupted by a concurrent change.
        interrupted: bool,
    },
    Errno(i32),
}

/// Encodes `tx` into a batch whose messages are numbered from `seq`.
fn encode_batch(tx: &Transaction, seq: u32) -> Result<encode::Batch, NftError> {
    if let Some((index, refused)) = crate::testhooks::refused_op(tx) {
        return Err(NftError::Encode {
            index,
            op: describe_op(tx.family, &refused),
            refused: Box::new(refused),
            reason: "refused by NFTPROXY_TEST_REFUSE (a test hook)".into(),
        });
    }
    encode::encode_transaction(tx, seq).map_err(|e| NftError::Encode {
        index: e.index,
        op: describe_op(tx.family, &tx.ops[e.index]),
        refused: Box::new(tx.ops[e.index].clone()),
        reason: e.reason,
    })
}

impl Nftables {
    /// Opens a `NETLINK_NETFILTER` socket in the calling thread's network namespace.
    pub fn open() -> Result<Nftables, NftError> {
        let sock = NlSocket::open().map_err(NftError::io("socket setup"))?;
        Ok(Nftables {
            sock,
            seq: 1,
            commits: 0,
            last_read: ReadStats::default(),
            notes: socket::Notifications::open()
                .inspect_err(|e| {
                    tracing::warn!(error = %e, "no nftables change notifications for table reads")
                })
                .ok(),
        })
    }

    /// The netlink port id of this connection (nf_tables notifications name their cause by it).
    pub fn portid(&self) -> u32 {
        self.sock.portid()
    }

    /// The ruleset generation: nf_tables counts every committed transaction (of any table).
    pub fn generation(&mut self) -> Result<u32, NftError> {
        dump::generation(self, Family::V4)
    }

    /// How many batches this handle had committed so far.
    pub fn commits(&self) -> u64 {
        self.commits
    }

    /// Reads back table `nftproxy` of `family`; `Ok(None)` if the table does not exist.
    pub fn read_table(&mut self, family: Family) -> Result<Option<TableState>, NftError> {
        dump::read_table(self, family)
    }

    /// How the last [`Nftables::read_table`] went (attempts, interrupted dumps, time).
    pub fn last_read(&self) -> ReadStats {
        self.last_read
    }

    /// Sends transactions one after the other (the parts of a split transaction), stopping at
    /// the first that fails. Each one that commits is handed to `committed` and then freed, so
    /// that the parts of a cold start are not all held until the last one is through.
    ///
    /// nf_tables commits a batch inside `send`, on the sending thread; meanwhile a second
    /// thread encodes the next part, so that encoding (about a fifth of a cold start) overlaps
    /// the kernel's work. At most two batches exist at a time.
    pub fn apply_all(
        &mut self,
        mut txs: Vec<Transaction>,
        mut committed: impl FnMut(&Transaction),
    ) -> Result<ApplyStats, NftError> {
        // An empty transaction sends nothing (see `apply`).
        txs.retain(|tx| !tx.is_empty());
        match txs.as_slice() {
            [] => return Ok(ApplyStats::default()),
            [tx] => {
                let stats = self.apply(tx)?;
                committed(tx);
                return Ok(stats);
            }
            _ => {}
        }
        let first_seq = self.seq;
        std::thread::scope(|scope| {
            let (to_sender, encoded) = mpsc::sync_channel(0);
            scope.spawn(move || {
                let mut seq = first_seq;
                for tx in txs {
                    let batch = encode_batch(&tx, seq);
                    if let Ok(b) = &batch {
                        seq = b.end_seq().wrapping_add(1);
                    }
                    let failed = batch.is_err();
                    // The receiver is gone once a part failed: stop encoding.
                    if to_sender.send((tx, batch)).is_err() || failed {
                        break;
                    }
                }
            });
            let mut total = ApplyStats::default();
            for (tx, batch) in encoded {
                let batch = batch?;
                self.seq = batch.end_seq().wrapping_add(1);
                let s = self.send_batch(&tx, &batch)?;
                total.messages += s.messages;
                total.bytes += s.bytes;
                committed(&tx);
            }
            Ok(total)
        })
    }

    /// Sends one transaction atomically. An empty transaction sends nothing.
    pub fn apply(&mut self, tx: &Transaction) -> Result<ApplyStats, NftError> {
        if tx.is_empty() {
            return Ok(ApplyStats::default());
        }
        let batch = encode_batch(tx, self.seq)?;
        self.seq = batch.end_seq().wrapping_add(1);
        self.send_batch(tx, &batch)
    }

    /// Sends `tx`'s encoded batch and waits for the kernel's verdict on it.
    fn send_batch(
        &mut self,
        tx: &Transaction,
        batch: &encode::Batch,
    ) -> Result<ApplyStats, NftError> {
        self.sock
            .ensure_buffers(batch.buf.len(), batch.messages())
            .map_err(NftError::io("socket buffer sizing"))?;
        self.sock
            .send(&batch.buf)
            .map_err(NftError::io("sending the batch"))?;
        let errors = self.batch_replies(batch)?;
        if let Some(&(seq, errno)) = errors
            .iter()
            .min_by_key(|(seq, _)| seq.wrapping_sub(batch.begin_seq))
        {
            let source = io::Error::from_raw_os_error(errno);
            return Err(match batch.op_of_seq(seq) {
                Some(index) => NftError::Op {
                    index,
                    op: describe_op(tx.family, &tx.ops[index]),
                    refused: Box::new(tx.ops[index].clone()),
                    errno,
                    also_failed: errors.len() - 1,
                    source,
                },
                None => NftError::Batch { errno, source },
            });
        }
        self.commits += 1;
        Ok(ApplyStats {
            messages: batch.messages(),
            bytes: batch.buf.len(),
        })
    }

    /// Sends a batch that is not a transaction's (its replies are read by the caller).
    fn send_raw_batch(&mut self, batch: &encode::Batch) -> Result<(), NftError> {
        self.sock
            .ensure_buffers(batch.buf.len(), batch.messages())
            .map_err(NftError::io("socket buffer sizing"))?;
        self.sock
            .send(&batch.buf)
            .map_err(NftError::io("sending the batch"))
    }

    /// Deletes table `nftproxy` of `family` if present; `Ok(false)` if it was absent.
    pub fn delete_table(&mut self, family: Family) -> Result<bool, NftError> {
        if !self.table_exists(family)? {
            return Ok(false);
        }
        let tx = Transaction {
            family,
            ops: vec![Op::DeleteTable],
        };
        match self.apply(&tx) {
            Ok(_) => Ok(true),
            // Deleted by someone else in between.
            Err(NftError::Op { errno, .. }) if errno == libc::ENOENT => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// Deletes table `name` of `family` — someone else's, such as kube-proxy's `kube-proxy`
    /// tables (`nftproxy cleanup --kube-proxy`) — if present; `Ok(false)` if it was absent.
    pub fn delete_named_table(&mut self, family: Family, name: &str) -> Result<bool, NftError> {
        if !self.named_table_exists(family, name)? {
            return Ok(false);
        }
        let batch = encode::encode_delete_named_table(family, name, self.seq);
        self.seq = batch.end_seq().wrapping_add(1);
        self.sock
            .send(&batch.buf)
            .map_err(NftError::io("sending the batch"))?;
        match self.batch_replies(&batch)?.first() {
            None => Ok(true),
            // Deleted by someone else in between.
            Some(&(_, libc::ENOENT)) => Ok(false),
            Some(&(_, errno)) => Err(NftError::Batch {
                errno,
                source: io::Error::from_raw_os_error(errno),
            }),
        }
    }

    pub(super) fn table_exists(&mut self, family: Family) -> Result<bool, NftError> {
        self.named_table_exists(family, TABLE)
    }

    fn named_table_exists(&mut self, family: Family, name: &str) -> Result<bool, NftError> {
        let get = NfTablesMessage::GetTable(TableMessage {
            attributes: vec![TableAttribute::Name(name.to_string())],
        });
        match self.request("get table", family, get, false)? {
            Reply::Messages { .. } => Ok(true),
            Reply::Errno(libc::ENOENT) => Ok(false),
            Reply::Errno(errno) => Err(NftError::Request {
                request: "get table",
                errno,
                source: io::Error::from_raw_os_error(errno),
            }),
        }
    }

    /// Collects the errors the kernel reported for `batch`, as `(seq, errno)`.
    fn batch_replies(&mut self, batch: &encode::Batch) -> Result<Vec<(u32, i32)>, NftError> {
        let last = batch.last_command_seq();
        let span = batch.end_seq().wrapping_sub(batch.begin_seq);
        let mut errors = Vec::new();
        let mut done = false;
        let mut overrun = false;
        // The kernel processed the batch inside send(): its replies are queued already. Read
        // without blocking; block only if, against expectations, nothing decisive is queued.
        let mut nonblocking = true;
        loop {
            let datagram = match self.sock.recv(nonblocking) {
                Ok(Some(d)) => d,
                Ok(None) if done || overrun => break,
                Ok(None) => {
                    nonblocking = false;
                    continue;
                }
                Err(e) if e.raw_os_error() == Some(libc::ENOBUFS) => {
                    // Replies were dropped: only errors can be that many, so the batch failed.
                    overrun = true;
                    nonblocking = true;
                    continue;
                }
                Err(e) => {
                    return Err(NftError::Io {
                        context: "reading the batch replies",
                        source: e,
                    });
                }
            };
            let msgs = socket::messages(datagram).map_err(|reason| NftError::Decode {
                request: "batch",
                reason,
            })?;
            for m in msgs {
                if m.seq.wrapping_sub(batch.begin_seq) > span || m.kind != NLMSG_ERROR {
                    continue; // A stale reply to an earlier request.
                }
                let errno = m.error_code().unwrap_or(libc::EPROTO);
                if errno != 0 {
                    errors.push((m.seq, errno));
                }
                if m.seq == last || (m.seq == batch.begin_seq && errno != 0) {
                    done = true;
                }
            }
            if done {
                nonblocking = true;
            }
        }
        if errors.is_empty() && overrun {
            errors.push((batch.begin_seq, libc::ENOBUFS));
        }
        Ok(errors)
    }

    /// Sends one request (a dump if `dump`, else a get answered by its ACK) and collects the
    /// reply messages.
    pub(super) fn request(
        &mut self,
        what: &'static str,
        family: Family,
        msg: NfTablesMessage,
        dump: bool,
    ) -> Result<Reply, NftError> {
        let seq = self.seq;
        self.seq = self.seq.wrapping_add(1);
        let mut buf = Vec::new();
        let flags = if dump { NLM_F_DUMP } else { NLM_F_ACK };
        encode::push_message(
            &mut buf,
            NetfilterHeader::new(encode::nfproto(family), 0, 0),
            msg.into(),
            flags,
            seq,
        );
        self.sock
            .send(&buf)
            .map_err(NftError::io("sending a request"))?;
        let mut messages = Vec::new();
        let mut interrupted = false;
        loop {
            let Some(datagram) = self
                .sock
                .recv(false)
                .map_err(NftError::io("reading a reply"))?
            else {
                continue;
            };
            let msgs = socket::messages(datagram).map_err(|reason| NftError::Decode {
                request: what,
                reason,
            })?;
            for m in msgs {
                if m.seq != seq {
                    continue; // A stale reply to an earlier request.
                }
                if m.flags & NLM_F_DUMP_INTR != 0 {
                    interrupted = true;
                }
                match m.kind {
                    NLMSG_ERROR => {
                        let errno = m.error_code().unwrap_or(libc::EPROTO);
                        if errno != 0 {
                            return Ok(Reply::Errno(errno));
                        }
                        if !dump {
                            return Ok(Reply::Messages {
                                messages,
                                interrupted,
                            });
                        }
                    }
                    NLMSG_DONE if dump => {
                        let errno = m.done_code();
                        if errno != 0 {
                            return Ok(Reply::Errno(errno));
                        }
                        return Ok(Reply::Messages {
                            messages,
                            interrupted,
                        });
                    }
                    _ => messages.push(m.bytes.to_vec()),
                }
            }
        }
    }
}
