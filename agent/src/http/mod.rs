//! The agent's HTTP endpoints: `/metrics` ([`metrics`]), `/healthz` and `/livez` ([`health`]),
//! and the per-Service health-check node ports ([`service_health`]).
//!
//! All of them are small answers computed from in-memory state, served by one hardened HTTP/1
//! server loop ([`serve`]): header size and count limits, a header read timeout (which also
//! closes idle keep-alive connections and slow-loris clients), a cap on a connection's lifetime,
//! and an accept loop that survives descriptor exhaustion. Every listener of the process draws
//! its connections from one [`Budget`] (a total and a per-source cap, see [`budget`]). A
//! connection costs no HTTP buffers until its first bytes arrive, and the health endpoints use
//! hyper's smallest buffers ([`Limits::health`]). Malformed requests get hyper's 400 and the
//! connection is closed.

pub mod budget;
pub mod health;
pub mod metrics;
pub mod service_health;

use std::convert::Infallible;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::{Body, Frame, Incoming, SizeHint};
use hyper::header::{CONTENT_LENGTH, CONTENT_TYPE, DATE, HeaderValue};
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::{TcpListener, TcpStream};

pub use self::budget::Budget;
use self::budget::{Admitted, Busy};

/// Per-listener limits that keep a misbehaving client from starving others (the number of
/// connections is the shared [`Budget`]'s business).
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// Time a client gets to send a request's headers (from the connection's start, or from
    /// the end of its previous response).
    pub header_read_timeout: Duration,
    /// Longest a connection may stay open, however busy.
    pub connection_lifetime: Duration,
    /// Bytes of a request head (request line and headers); larger heads get 431.
    pub max_header_bytes: usize,
    /// Headers per request.
    pub max_headers: usize,
    /// hyper's read and write buffer limit (at least 8 KiB, hyper's smallest).
    pub max_buf_size: usize,
    /// Vectored writes: the body is written from its own buffer instead of being copied into
    /// the connection's. Worth it for large answers (`/metrics`); the health answers are a
    /// few hundred bytes and go out in one copy.
    pub writev: bool,
}

impl Limits {
    /// `/healthz`, `/livez` and the health-check node ports: load balancers and kubelets send
    /// a few hundred bytes of headers at once, and answers are a few hundred bytes.
    pub fn health() -> Limits {
        Limits {
            header_read_timeout: Duration::from_secs(2),
            connection_lifetime: Duration::from_secs(30),
            max_header_bytes: 4 * 1024,
            max_headers: 32,
            max_buf_size: 8 * 1024,
            writev: false,
        }
    }

    /// `/metrics` (and `/configz`): a scraper may send credentials; answers can be large.
    pub fn metrics() -> Limits {
        Limits {
            header_read_timeout: Duration::from_secs(5),
            connection_lifetime: Duration::from_secs(60),
            max_header_bytes: 16 * 1024,
            max_headers: 64,
            max_buf_size: 32 * 1024,
            writev: true,
        }
    }

    fn builder(&self) -> hyper::server::conn::http1::Builder {
        let mut builder = hyper::server::conn::http1::Builder::new();
        builder
            .timer(TokioTimer::new())
            .header_read_timeout(self.header_read_timeout)
            .max_buf_size(self.max_buf_size.max(8192))
            .max_header_size(self.max_header_bytes)
            .max_headers(self.max_headers)
            .writev(self.writev)
            .pipeline_flush(false)
            .title_case_headers(true)
            .keep_alive(true);
        builder
    }
}

/// A request handler: the whole answer, computed without waiting.
pub type Handler = Arc<dyn Fn(&Request<Incoming>) -> Response<Full<Bytes>> + Send + Sync>;

/// A response body that keeps its connection marked busy (see [`Budget`]) until hyper is done
/// with it.
struct Tracked {
    body: Full<Bytes>,
    _busy: Busy,
}

impl Body for Tracked {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

/// Serves `listener` until the future is dropped (a server task aborted), which also ends every
/// connection it accepted. Connections are admitted by `budget`.
pub async fn serve(
    listener: TcpListener,
    handler: Handler,
    limits: Limits,
    budget: Arc<Budget>,
    what: &'static str,
) {
    let builder = Arc::new(limits.builder());
    let mut accept_errors = 0u64;
    let mut connections = tokio::task::JoinSet::new();
    loop {
        while connections.try_join_next().is_some() {}
        let (stream, peer) = match listener.accept().await {
            Ok(conn) => conn,
            Err(e) => {
                // EMFILE/ENFILE/ENOBUFS: back off instead of spinning; the listener stays.
                accept_errors += 1;
                if accept_errors.is_power_of_two() {
                    tracing::warn!(server = what, error = %e, count = accept_errors, "accept failed");
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let Ok(admitted) = budget.admit(peer.ip()) else {
            // Closed at once, with a reset: no orphaned socket lingers for a flooding peer.
            let _ = stream.set_zero_linger();
            continue;
        };
        let _ = stream.set_nodelay(true);
        connections.spawn(connection(
            stream,
            admitted,
            handler.clone(),
            builder.clone(),
            limits,
        ));
    }
}

/// Serves one connection until it ends, its lifetime is over or the budget closes it.
async fn connection(
    stream: TcpStream,
    admitted: Admitted,
    handler: Handler,
    builder: Arc<hyper::server::conn::http1::Builder>,
    limits: Limits,
) {
    // Connections a flood opens together would otherwise time out together, and their
    // teardown would hold up everyone else's answers: each gets 75-100% of the limit.
    let header_timeout = limits
        .header_read_timeout
        .mul_f64(0.75 + 0.25 * admitted.spread());
    let admitted = Arc::new(admitted);
    let served = {
        let admitted = admitted.clone();
        async move {
            // Until its first bytes arrive a connection holds no HTTP state or buffers (hyper
            // allocates 16 KiB per connection as soon as it starts reading). `peek` waits for a
            // byte without taking it; `readable` would do, but completes at once for a freshly
            // accepted socket (a false positive tokio allows), before anything was sent.
            let mut first = [0u8; 1];
            match tokio::time::timeout(header_timeout, stream.peek(&mut first)).await {
                Ok(Ok(1..)) => {}
                _ => return,
            }
            if !admitted.activate() {
                return;
            }
            let service = hyper::service::service_fn(move |req: Request<Incoming>| {
                let busy = admitted.busy();
                let resp = handler(&req).map(|body| Tracked { body, _busy: busy });
                async move { Ok::<_, Infallible>(resp) }
            });
            let mut builder = (*builder).clone();
            builder.header_read_timeout(header_timeout);
            // Boxed: the (large) connection state is allocated only for connections that send.
            let conn = Box::pin(builder.serve_connection(TokioIo::new(stream), service));
            // Errors are the client's (bad request, reset, timeout): nothing to report.
            let _ = conn.await;
        }
    };
    tokio::select! {
        _ = tokio::time::timeout(limits.connection_lifetime, served) => {}
        _ = admitted.evicted() => {}
    }
}

/// A response with Go net/http's header order: the handler's headers, then `Date` and
/// `Content-Length`.
pub fn response(
    status: StatusCode,
    headers: &[(&'static str, String)],
    body: impl Into<Bytes>,
) -> Response<Full<Bytes>> {
    let body: Bytes = body.into();
    let mut resp = Response::new(Full::new(body.clone()));
    *resp.status_mut() = status;
    let h = resp.headers_mut();
    for (name, value) in headers {
        if let Ok(v) = HeaderValue::from_str(value) {
            h.append(*name, v);
        }
    }
    if let Ok(v) = HeaderValue::from_str(&httpdate::fmt_http_date(SystemTime::now())) {
        h.insert(DATE, v);
    }
    h.insert(CONTENT_LENGTH, HeaderValue::from(body.len()));
    resp
}

/// Go's `http.NotFound`.
pub fn not_found() -> Response<Full<Bytes>> {
    response(
        StatusCode::NOT_FOUND,
        &[
            (CONTENT_TYPE.as_str(), "text/plain; charset=utf-8".into()),
            ("X-Content-Type-Options", "nosniff".into()),
        ],
        "404 page not found\n",
    )
}

/// Parses a kube-proxy bind address (`0.0.0.0:10256`, `[::]:10256`, or an IP alone, which gets
/// `default_port`). `None` for an empty address (the server is disabled).
pub fn parse_bind_address(s: &str, default_port: u16) -> Result<Option<SocketAddr>, String> {
    let s = s.trim();
    if s.is_empty() {
        return Ok(None);
    }
    if let Ok(sa) = s.parse::<SocketAddr>() {
        return Ok(Some(sa));
    }
    let bare = s.trim_start_matches('[').trim_end_matches(']');
    if let Ok(ip) = bare.parse::<IpAddr>() {
        return Ok(Some(SocketAddr::new(ip, default_port)));
    }
    Err(format!(
        "{s:?} is not an address such as 0.0.0.0:{default_port}"
    ))
}

/// A listening socket like Go's: `SO_REUSEADDR`, and for IPv6 wildcards `v6only` as asked.
pub fn listen(addr: SocketAddr, v6only: bool) -> std::io::Result<std::net::TcpListener> {
    use socket2::{Domain, Protocol, Socket, Type};
    let socket = Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP))?;
    socket.set_reuse_address(true)?;
    if addr.is_ipv6() {
        socket.set_only_v6(v6only)?;
    }
    socket.set_nonblocking(true)?;
    socket.bind(&addr.into())?;
    socket.listen(1024)?;
    Ok(socket.into())
}

/// Binds `addr` the way Go's `net.Listen("tcp", addr)` does: the IPv4 wildcard `0.0.0.0` opens
/// a dual-stack socket (`[::]` with `IPV6_V6ONLY` off) where the host has IPv6, so kube-proxy's
/// default `0.0.0.0:10256` also answers on the node's IPv6 addresses; an IPv6 wildcard serves
/// IPv4 too. Other addresses are bound as they are.
pub fn listen_like_go(addr: SocketAddr) -> std::io::Result<std::net::TcpListener> {
    if addr.ip() == IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED) {
        let dual = SocketAddr::new(IpAddr::V6(std::net::Ipv6Addr::UNSPECIFIED), addr.port());
        if let Ok(l) = listen(dual, false) {
            return Ok(l);
        }
    }
    listen(addr, false)
}

/// Binds `addr` and serves it on `rt`. When the address cannot be bound, kube-proxy's servers
/// log and retry every 5 s, unless `bindAddressHardFail` asks them to give up: then the error
/// is returned and the caller exits.
pub fn spawn_server(
    rt: &tokio::runtime::Handle,
    addr: SocketAddr,
    handler: Handler,
    what: &'static str,
    hard_fail: bool,
) -> Result<(), String> {
    let first = listen_like_go(addr);
    if hard_fail && let Err(e) = &first {
        return Err(format!("{what} server: cannot listen on {addr}: {e}"));
    }
    rt.spawn(async move {
        let mut attempt = first;
        let mut logged = false;
        loop {
            match attempt.and_then(TcpListener::from_std) {
                Ok(l) => {
                    let local = l.local_addr().unwrap_or(addr);
                    tracing::info!(server = what, addr = %local, "serving");
                    let limits = if what == "metrics" {
                        Limits::metrics()
                    } else {
                        Limits::health()
                    };
                    serve(l, handler, limits, Budget::shared(), what).await;
                    return;
                }
                Err(e) => {
                    if !logged {
                        tracing::error!(server = what, %addr, error = %e, "cannot listen; retrying every 5s");
                        logged = true;
                    }
                    tokio::time::sleep(Duration::from_secs(5)).await;
                }
            }
            attempt = listen_like_go(addr);
        }
    });
    Ok(())
}

/// Raises the soft open-files limit to the hard limit (as Go programs do at startup): every
/// HTTP connection costs a descriptor, and the default soft limit of 1024 is easy to exhaust.
pub fn raise_fd_limit() {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit only read and write the struct we pass.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) == 0 && lim.rlim_cur < lim.rlim_max {
            lim.rlim_cur = lim.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &lim);
        }
    }
}

/// Formats a time like Go's `time.Time` JSON encoding (RFC 3339 with nanoseconds, trailing
/// zeros trimmed), in UTC.
pub fn rfc3339_nano(t: SystemTime) -> String {
    let (secs, nanos) = match t.duration_since(SystemTime::UNIX_EPOCH) {
        Ok(d) => (d.as_secs() as i64, d.subsec_nanos()),
        Err(e) => {
            let d = e.duration();
            let mut secs = -(d.as_secs() as i64);
            let mut nanos = d.subsec_nanos();
            if nanos > 0 {
                secs -= 1;
                nanos = 1_000_000_000 - nanos;
            }
            (secs, nanos)
        }
    };
    let days = secs.div_euclid(86_400);
    let rem = secs.rem_euclid(86_400);
    let (y, m, d) = civil_from_days(days);
    let mut out = format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    );
    if nanos > 0 {
        let frac = format!("{nanos:09}");
        out.push('.');
        out.push_str(frac.trim_end_matches('0'));
    }
    out.push('Z');
    out
}

/// Go's zero `time.Time` in JSON.
pub const GO_ZERO_TIME: &str = "0001-01-01T00:00:00Z";

/// Days since 1970-01-01 to (year, month, day), proleptic Gregorian (H. Hinnant's algorithm).
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (if m <= 2 { y + 1 } else { y }, m, d)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_format_like_go_json() {
        let t = |s: u64, n: u32| SystemTime::UNIX_EPOCH + Duration::new(s, n);
        assert_eq!(rfc3339_nano(t(0, 0)), "1970-01-01T00:00:00Z");
        assert_eq!(
            rfc3339_nano(t(1_764_690_806, 120_000_000)),
            "2025-12-02T15:53:26.12Z"
        );
        assert_eq!(
            rfc3339_nano(t(951_782_400, 1)),
            "2000-02-29T00:00:00.000000001Z"
        );
        assert_eq!(rfc3339_nano(t(4_107_542_400, 0)), "2100-03-01T00:00:00Z");
    }

    #[test]
    fn formatted_times_parse_back() {
        for t in [
            "1970-01-01T00:00:00Z",
            "2025-12-02T15:53:26.12Z",
            "2000-02-29T00:00:00.000000001Z",
            "2100-03-01T00:00:00Z",
            "1960-06-15T12:00:00Z",
        ] {
            let parsed: k8s_openapi::jiff::Timestamp = t.parse().unwrap();
            assert_eq!(rfc3339_nano(SystemTime::from(parsed)), t);
        }
    }

    async fn get_from(src: &str, addr: SocketAddr) -> String {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let sock = tokio::net::TcpSocket::new_v4().unwrap();
        sock.bind(format!("{src}:0").parse().unwrap()).unwrap();
        let mut s = sock.connect(addr).await.unwrap();
        s.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            .await
            .unwrap();
        let mut text = String::new();
        tokio::time::timeout(Duration::from_secs(5), s.read_to_string(&mut text))
            .await
            .expect("an answer in time")
            .unwrap();
        text
    }

    /// Whether the server closed `s` (within a moment).
    async fn closed(s: &mut TcpStream) -> bool {
        use tokio::io::AsyncReadExt;
        let mut buf = [0u8; 16];
        matches!(
            tokio::time::timeout(Duration::from_millis(200), s.read(&mut buf)).await,
            Ok(Ok(0) | Err(_))
        )
    }

    #[tokio::test]
    async fn floods_cannot_shut_out_other_sources() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let budget = Budget::new(8, 4, 8);
        let handler: Handler =
            Arc::new(|_: &Request<Incoming>| response(StatusCode::OK, &[], "ok"));
        let server = tokio::spawn(serve(
            listener,
            handler,
            Limits::health(),
            budget.clone(),
            "test",
        ));

        // One source opens 20 idle connections: it keeps its newest 4.
        let mut flood = Vec::new();
        for _ in 0..20 {
            flood.push(TcpStream::connect(addr).await.unwrap());
        }
        let answer = get_from("127.0.0.2", addr).await;
        assert!(answer.starts_with("HTTP/1.1 200 OK\r\n"), "{answer}");
        assert!(answer.ends_with("\r\n\r\nok"), "{answer}");
        let mut open = 0;
        for s in &mut flood {
            open += usize::from(!closed(s).await);
        }
        assert_eq!(open, 4);
        assert!(
            !closed(flood.last_mut().unwrap()).await,
            "the newest one was closed"
        );

        // Many sources: the budget (8) is spent, the oldest idle connections make room.
        let mut many = Vec::new();
        for i in 10..40 {
            let sock = tokio::net::TcpSocket::new_v4().unwrap();
            sock.bind(format!("127.0.0.{i}:0").parse().unwrap())
                .unwrap();
            many.push(sock.connect(addr).await.unwrap());
        }
        let answer = get_from("127.0.0.3", addr).await;
        assert!(answer.starts_with("HTTP/1.1 200 OK\r\n"), "{answer}");
        let stats = budget.stats();
        assert!(stats.open <= 8, "{stats:?}");
        assert!(stats.evicted >= 16 + 20, "{stats:?}");
        assert_eq!(stats.refused, 0, "{stats:?}");
        server.abort();
    }

    #[test]
    fn bind_addresses() {
        assert_eq!(
            parse_bind_address("0.0.0.0:10256", 1).unwrap(),
            Some("0.0.0.0:10256".parse().unwrap())
        );
        assert_eq!(
            parse_bind_address("[::]:10256", 1).unwrap(),
            Some("[::]:10256".parse().unwrap())
        );
        assert_eq!(
            parse_bind_address("127.0.0.1", 10249).unwrap(),
            Some("127.0.0.1:10249".parse().unwrap())
        );
        assert_eq!(
            parse_bind_address("::1", 10249).unwrap(),
            Some("[::1]:10249".parse().unwrap())
        );
        assert_eq!(parse_bind_address("", 1).unwrap(), None);
        assert!(parse_bind_address("nonsense", 1).is_err());
    }
}
