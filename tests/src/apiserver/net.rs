//! Connections and sockets: registering and serving connections, binding listeners, entering
//! network namespaces.

use super::*;

/// Registers a connection in [`Shared::conns`] while it lives.
pub(super) struct ConnGuard(Arc<Shared>, u64);

impl Drop for ConnGuard {
    fn drop(&mut self) {
        lock(&self.0.conns.0).remove(&self.1);
        self.0.conns.1.notify_all();
    }
}

pub(super) fn spawn_connection(shared: &Arc<Shared>, stream: tokio::net::TcpStream) {
    // As Go's net package (and so kube-apiserver) does: without it, a watch event written
    // while the previous one is unacknowledged waits for the client's delayed ACK (40 ms).
    if let Err(e) = stream.set_nodelay(true) {
        eprintln!("apiserver: TCP_NODELAY: {e}");
    }
    let mut kill = shared.kill.subscribe();
    let id = shared.conn_ids.fetch_add(1, Ordering::Relaxed);
    lock(&shared.conns.0).insert(id, *kill.borrow());
    let guard = ConnGuard(shared.clone(), id);
    let shared = shared.clone();
    tokio::spawn(async move {
        let conn = async {
            match shared.tls.clone() {
                None => serve_http(shared, stream).await,
                Some(tls) => match tls.accept(stream).await {
                    Ok(stream) => serve_http(shared, stream).await,
                    // E.g. a client that does not trust the CA.
                    Err(e) => eprintln!("apiserver: TLS handshake: {e}"),
                },
            }
        };
        tokio::select! {
            biased;
            _ = kill.changed() => {}
            _ = conn => {}
        }
        drop(guard);
    });
}

/// Serves HTTP/1.1 requests on one connection until it ends.
pub(super) async fn serve_http<S>(shared: Arc<Shared>, stream: S)
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let svc = hyper::service::service_fn(move |req| http::handle(shared.clone(), req));
    let _ = hyper::server::conn::http1::Builder::new()
        .serve_connection(TokioIo::new(stream), svc)
        .await;
}

pub(super) fn bind(addr: SocketAddr) -> Result<TcpListener> {
    let socket = match addr {
        SocketAddr::V4(_) => TcpSocket::new_v4()?,
        SocketAddr::V6(_) => TcpSocket::new_v6()?,
    };
    socket.set_reuseaddr(true)?;
    socket
        .bind(addr)
        .with_context(|| format!("binding {addr}"))?;
    Ok(socket.listen(128)?)
}

/// Moves the calling thread into the network namespace `/run/netns/<name>`.
pub fn enter_netns(name: &str) -> Result<()> {
    let path = Path::new("/run/netns").join(name);
    let file = std::fs::File::open(&path).with_context(|| path.display().to_string())?;
    // SAFETY: setns on a valid namespace fd only changes this thread's network namespace.
    let rc = unsafe { libc::setns(std::os::fd::AsRawFd::as_raw_fd(&file), libc::CLONE_NEWNET) };
    if rc != 0 {
        bail!(
            "setns {}: {}",
            path.display(),
            std::io::Error::last_os_error()
        );
    }
    Ok(())
}

/// Runs `f` on a new thread inside the network namespace `/run/netns/<name>` and returns
/// its result (e.g. a kube client talking to an [`ApiServer`] there).
pub fn in_netns<T: Send>(name: &str, f: impl FnOnce() -> T + Send) -> Result<T> {
    std::thread::scope(|s| {
        s.spawn(|| {
            enter_netns(name)?;
            Ok(f())
        })
        .join()
        .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
    })
}
