//! A TCP proxy on loopback that can make the network go *silent*: no FIN,
//! no RST, just no more bytes, as when a failover leaves the old primary's
//! address unanswered.
//!
//! [`SilentProxy::silence`] stops forwarding on every open connection, both
//! ways, and keeps their sockets open; connections accepted while silent
//! are accepted and never forwarded. [`SilentProxy::heal`] forwards again
//! for *new* connections only: the ones that went silent stay silent (and
//! open) until the proxy is dropped.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinSet;

/// A proxy from a loopback port to `upstream`; dropping it closes every
/// connection.
pub struct SilentProxy {
    port: u16,
    /// Bumped by every [`SilentProxy::silence`]: a connection forwards only
    /// while the generation it was opened in is current.
    generation: watch::Sender<u64>,
    silent: Arc<AtomicBool>,
    tasks: Arc<std::sync::Mutex<JoinSet<()>>>,
    accept: tokio::task::JoinHandle<()>,
}

impl SilentProxy {
    /// Listens on an ephemeral port of 127.0.0.1, forwarding to `upstream`
    /// (`host:port`).
    pub async fn start(upstream: &str) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the proxy");
        let port = listener.local_addr().expect("proxy address").port();
        let (generation, _) = watch::channel(0u64);
        let silent = Arc::new(AtomicBool::new(false));
        let tasks = Arc::new(std::sync::Mutex::new(JoinSet::new()));
        let accept = tokio::spawn(accept_loop(
            listener,
            upstream.to_owned(),
            generation.clone(),
            Arc::clone(&silent),
            Arc::clone(&tasks),
        ));
        Self {
            port,
            generation,
            silent,
            tasks,
            accept,
        }
    }

    /// The port clients connect to.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Stops forwarding on every open connection (sockets stay open) and
    /// leaves new connections accepted but never forwarded.
    pub fn silence(&self) {
        self.silent.store(true, Ordering::SeqCst);
        self.generation.send_modify(|g| *g += 1);
    }

    /// Forwards again, for connections accepted from now on.
    pub fn heal(&self) {
        self.silent.store(false, Ordering::SeqCst);
    }
}

impl Drop for SilentProxy {
    fn drop(&mut self) {
        self.accept.abort();
        if let Ok(mut tasks) = self.tasks.lock() {
            tasks.abort_all();
        }
    }
}

async fn accept_loop(
    listener: TcpListener,
    upstream: String,
    generation: watch::Sender<u64>,
    silent: Arc<AtomicBool>,
    tasks: Arc<std::sync::Mutex<JoinSet<()>>>,
) {
    loop {
        let Ok((client, _)) = listener.accept().await else {
            continue;
        };
        let Ok(mut tasks) = tasks.lock() else {
            return;
        };
        if silent.load(Ordering::SeqCst) {
            // Accepted, never answered: hold the socket open.
            tasks.spawn(hold(vec![client]));
        } else {
            tasks.spawn(forward(client, upstream.clone(), generation.subscribe()));
        }
    }
}

/// Keeps sockets open and silent until the task is aborted.
async fn hold(sockets: Vec<TcpStream>) {
    std::future::pending::<()>().await;
    drop(sockets);
}

/// Forwards both ways until either side closes, or until the generation
/// changes (silence): then holds both sockets open, forwarding nothing.
async fn forward(client: TcpStream, upstream: String, mut generation: watch::Receiver<u64>) {
    let opened_in = *generation.borrow_and_update();
    let Ok(server) = TcpStream::connect(&upstream).await else {
        return;
    };
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let (mut client, mut server) = (client, server);
    let mut up = [0u8; 16 * 1024];
    let mut down = [0u8; 16 * 1024];
    loop {
        if *generation.borrow() != opened_in {
            return hold(vec![client, server]).await;
        }
        tokio::select! {
            biased;
            changed = generation.changed() => {
                if changed.is_err() {
                    return;
                }
            }
            n = client.read(&mut up) => match n {
                Ok(0) | Err(_) => return,
                Ok(n) => {
                    if *generation.borrow() != opened_in {
                        return hold(vec![client, server]).await;
                    }
                    if server.write_all(&up[..n]).await.is_err() {
                        return;
                    }
                }
            },
            n = server.read(&mut down) => match n {
                Ok(0) | Err(_) => return,
                Ok(n) => {
                    if *generation.borrow() != opened_in {
                        return hold(vec![client, server]).await;
                    }
                    if client.write_all(&down[..n]).await.is_err() {
                        return;
                    }
                }
            },
        }
    }
}
