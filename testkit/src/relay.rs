//! A TCP relay whose forwarding a test can hold, to make a server stop answering one client.

use std::time::Duration;

/// A TCP relay in front of a server whose forwarding can be held: while held, bytes are read and
/// kept, not passed on, so connections stay open and nothing answers, as a black-holed server or
/// a network that stopped answering one client looks. Released, the kept bytes flow on. For tests
/// of what a service does when a dependency stops answering; it runs until the test ends.
pub struct Relay {
    addr: std::net::SocketAddr,
    held: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl Relay {
    /// Starts a relay on a free local port to `upstream` (`host:port`).
    pub async fn start(upstream: &str) -> std::io::Result<Self> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let held = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (flag, upstream) = (held.clone(), upstream.to_owned());
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let Ok(server) = tokio::net::TcpStream::connect(&upstream).await else { continue };
                let (cr, cw) = client.into_split();
                let (sr, sw) = server.into_split();
                tokio::spawn(relay_pipe(cr, sw, flag.clone()));
                tokio::spawn(relay_pipe(sr, cw, flag.clone()));
            }
        });
        Ok(Self { addr, held })
    }

    /// The relay's own address.
    pub fn addr(&self) -> std::net::SocketAddr {
        self.addr
    }

    /// Holds (`true`) or releases (`false`) every byte in both directions.
    pub fn hold(&self, held: bool) {
        self.held.store(held, std::sync::atomic::Ordering::Release);
    }
}

async fn relay_pipe(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    held: std::sync::Arc<std::sync::atomic::AtomicBool>,
) {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        while held.load(std::sync::atomic::Ordering::Acquire) {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}
