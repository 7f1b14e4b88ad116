//! The bytes under the `tcp` transport's frames: a plain socket, or TLS (rustls) over it when
//! `transport_encryption` is on. The frame logic above sees only [`Wire`] (target) and
//! [`SendWire`] / [`AckReader`] (initiator).
//!
//! Encrypted target connections are non-blocking like plain ones: a read first drains the
//! plaintext rustls already holds, then feeds it the socket's bytes. Encrypted initiators share
//! one rustls connection between the posting thread (which encrypts and writes, blocking) and
//! the acknowledgement reader (which reads the socket without the lock and takes it only to
//! decrypt): neither holds the lock while it waits for the other's progress, so the pair cannot
//! deadlock on TCP flow control.

use crate::Discard;
use std::io::{IoSlice, IoSliceMut, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::sync::{Arc, Mutex};

use rustls::pki_types::ServerName;

use crate::TransportError;

/// TLS on the `tcp` transport's connections (`[disagg] transport_encryption`).
#[derive(Clone, Debug, Default)]
pub enum KvEncryption {
    /// Plaintext frames (the pairing's challenge–response still authenticates every connection).
    #[default]
    Off,
    /// Target: every accepted connection is a TLS server session (client certificates required
    /// and verified by `config`).
    Server(Arc<rustls::ServerConfig>),
    /// Initiator: TLS to a target whose certificate names `server_name`.
    Client {
        config: Arc<rustls::ClientConfig>,
        server_name: ServerName<'static>,
    },
}

impl KvEncryption {
    pub fn is_on(&self) -> bool {
        !matches!(self, Self::Off)
    }
}

/// Plaintext a rustls session may buffer for the application before it must be read.
const TLS_BUFFER_BYTES: usize = 1 << 20;

/// Outcome of one non-blocking read.
pub(super) enum Io {
    Read(usize),
    Blocked,
    Closed,
}

fn io_of(r: std::io::Result<usize>) -> Option<Io> {
    match r {
        Ok(0) => Some(Io::Closed),
        Ok(n) => Some(Io::Read(n)),
        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => Some(Io::Blocked),
        Err(e) if e.kind() == std::io::ErrorKind::Interrupted => None,
        Err(_) => Some(Io::Closed),
    }
}

/// A target connection's bytes (non-blocking).
#[derive(Debug)]
pub(super) enum Wire {
    Plain(TcpStream),
    Tls(Box<TlsServerWire>),
}

#[derive(Debug)]
pub(super) struct TlsServerWire {
    conn: rustls::ServerConnection,
    sock: TcpStream,
    /// Socket bytes read but not yet fed to the session (`raw[raw_at..raw_len]`): the socket
    /// is read in large pieces, not in the session's own 4 KiB reads (a syscall each).
    raw: Box<[u8]>,
    raw_at: usize,
    raw_len: usize,
}

/// Socket bytes an encrypted target reads per `read` (a few records).
const TLS_RAW_READ_BYTES: usize = 256 << 10;

impl Wire {
    /// An authenticated TLS session over `sock` (handshake done), made non-blocking.
    pub(super) fn tls(mut conn: rustls::ServerConnection, sock: TcpStream) -> Self {
        conn.set_buffer_limit(Some(TLS_BUFFER_BYTES));
        Self::Tls(Box::new(TlsServerWire {
            conn,
            sock,
            raw: vec![0; TLS_RAW_READ_BYTES].into_boxed_slice(),
            raw_at: 0,
            raw_len: 0,
        }))
    }

    pub(super) fn read(&mut self, buf: &mut [u8]) -> Io {
        debug_assert!(!buf.is_empty());
        match self {
            Self::Plain(s) => loop {
                if let Some(io) = io_of(s.read(buf)) {
                    return io;
                }
            },
            Self::Tls(t) => t.read(&mut [IoSliceMut::new(buf)]),
        }
    }

    pub(super) fn read_vectored(&mut self, bufs: &mut [IoSliceMut<'_>]) -> Io {
        match self {
            Self::Plain(s) => loop {
                if let Some(io) = io_of(s.read_vectored(bufs)) {
                    return io;
                }
            },
            Self::Tls(t) => t.read(bufs),
        }
    }

    /// Write what the socket takes now (acknowledgements); `WouldBlock` when it takes nothing.
    pub(super) fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        match self {
            Self::Plain(s) => s.write(b),
            Self::Tls(t) => {
                t.flush_tls()?;
                let n = t.conn.writer().write(b)?;
                match t.flush_tls() {
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => Ok(n),
                    r => r.map(|()| n),
                }
            }
        }
    }

    /// Push out TLS records already encrypted but not yet written (nothing for plain sockets).
    pub(super) fn flush_pending(&mut self) -> std::io::Result<()> {
        match self {
            Self::Plain(_) => Ok(()),
            Self::Tls(t) => t.flush_tls(),
        }
    }

    pub(super) fn shutdown(&self) {
        let s = match self {
            Self::Plain(s) => s,
            Self::Tls(t) => &t.sock,
        };
        s.shutdown(Shutdown::Both)
            .discard("shutting down a socket that may already be gone");
    }
}

impl TlsServerWire {
    fn read(&mut self, bufs: &mut [IoSliceMut<'_>]) -> Io {
        loop {
            match self.conn.reader().read_vectored(bufs) {
                Ok(0) => return Io::Closed, // close_notify
                Ok(n) => return Io::Read(n),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(_) => return Io::Closed,
            }
            if self.raw_at == self.raw_len {
                match self.sock.read(&mut self.raw) {
                    Ok(0) => return Io::Closed,
                    Ok(n) => (self.raw_at, self.raw_len) = (0, n),
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return Io::Blocked,
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                    Err(_) => return Io::Closed,
                }
            }
            let mut fed: &[u8] = &self.raw[self.raw_at..self.raw_len];
            match self.conn.read_tls(&mut fed) {
                Ok(n) if n > 0 => self.raw_at += n,
                _ => return Io::Closed, // the session refused input: not a well-formed stream
            }
            if let Err(e) = self.conn.process_new_packets() {
                tracing::warn!(error = %e, "KV transport TLS: bad record, closing");
                self.conn
                    .write_tls(&mut self.sock)
                    .discard("the TLS close alert is best effort: the peer may be gone");
                return Io::Closed;
            }
        }
    }

    fn flush_tls(&mut self) -> std::io::Result<()> {
        while self.conn.wants_write() {
            if self.conn.write_tls(&mut self.sock)? == 0 {
                return Err(std::io::ErrorKind::WriteZero.into());
            }
        }
        Ok(())
    }
}

/// An initiator connection's sending side (blocking).
#[derive(Debug)]
pub(super) enum SendWire {
    Plain(TcpStream),
    Tls {
        conn: Arc<Mutex<rustls::ClientConnection>>,
        sock: TcpStream,
    },
}

impl SendWire {
    /// Write every byte of `bufs` (in order).
    pub(super) fn write_all_vectored(&mut self, bufs: &mut [IoSlice<'_>]) -> std::io::Result<()> {
        match self {
            Self::Plain(s) => write_all_vectored(s, bufs),
            Self::Tls { conn, sock } => {
                let mut c = conn
                    .lock()
                    .map_err(|_| std::io::Error::other("TLS session poisoned"))?;
                for b in bufs.iter() {
                    let mut rest: &[u8] = b;
                    while !rest.is_empty() {
                        let n = c.writer().write(rest)?;
                        rest = &rest[n..];
                        if n == 0 && !c.wants_write() {
                            return Err(std::io::ErrorKind::WriteZero.into());
                        }
                        while c.wants_write() {
                            c.write_tls(sock)?;
                        }
                    }
                }
                Ok(())
            }
        }
    }

    pub(super) fn shutdown(&self) {
        let s = match self {
            Self::Plain(s) | Self::Tls { sock: s, .. } => s,
        };
        s.shutdown(Shutdown::Both)
            .discard("shutting down a socket that may already be gone");
    }
}

pub(super) fn write_all_vectored(
    s: &mut TcpStream,
    mut bufs: &mut [IoSlice<'_>],
) -> std::io::Result<()> {
    IoSlice::advance_slices(&mut bufs, 0);
    while !bufs.is_empty() {
        match s.write_vectored(bufs) {
            Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
            Ok(n) => IoSlice::advance_slices(&mut bufs, n),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// The initiator's acknowledgement stream (blocking reads on its own thread).
#[derive(Debug)]
pub(super) enum AckReader {
    Plain(TcpStream),
    Tls {
        conn: Arc<Mutex<rustls::ClientConnection>>,
        sock: TcpStream,
        raw: Vec<u8>,
        plain: Vec<u8>,
        plain_at: usize,
    },
}

/// Socket bytes the TLS acknowledgement reader takes per read.
const ACK_RAW_BYTES: usize = 16 << 10;

impl AckReader {
    pub(super) fn tls(conn: Arc<Mutex<rustls::ClientConnection>>, sock: TcpStream) -> Self {
        Self::Tls {
            conn,
            sock,
            raw: vec![0; ACK_RAW_BYTES],
            plain: Vec::new(),
            plain_at: 0,
        }
    }
}

impl Read for AckReader {
    fn read(&mut self, out: &mut [u8]) -> std::io::Result<usize> {
        match self {
            Self::Plain(s) => s.read(out),
            Self::Tls {
                conn,
                sock,
                raw,
                plain,
                plain_at,
            } => loop {
                if *plain_at < plain.len() {
                    let n = out.len().min(plain.len() - *plain_at);
                    out[..n].copy_from_slice(&plain[*plain_at..*plain_at + n]);
                    *plain_at += n;
                    return Ok(n);
                }
                plain.clear();
                *plain_at = 0;
                // Read the socket without the lock: the posting thread may hold it while it
                // waits on flow control.
                let got = sock.read(raw)?;
                if got == 0 {
                    return Ok(0);
                }
                let mut c = conn
                    .lock()
                    .map_err(|_| std::io::Error::other("TLS session poisoned"))?;
                decrypt_into(&mut c, &raw[..got], plain)?;
            },
        }
    }
}

/// Feed `raw` socket bytes to the session and append the plaintext they carry to `plain`.
fn decrypt_into(
    c: &mut rustls::ClientConnection,
    mut raw: &[u8],
    plain: &mut Vec<u8>,
) -> std::io::Result<()> {
    while !raw.is_empty() {
        if c.read_tls(&mut raw)? == 0 {
            return Err(std::io::Error::other("TLS session refused more input"));
        }
        c.process_new_packets().map_err(std::io::Error::other)?;
        match c.reader().read_to_end(plain) {
            // close_notify: what came before it is served; the socket's EOF follows.
            Ok(_) => return Ok(()),
            // No more plaintext for now (what was read is in `plain`).
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// The TLS handshake of an initiator's new connection (blocking), then the pairing proof inside
/// it: the session, ready for frames.
pub(super) fn client_session(
    config: &Arc<rustls::ClientConfig>,
    server_name: &ServerName<'static>,
    sock: &mut TcpStream,
    pairing: &crate::Pairing,
) -> Result<rustls::ClientConnection, TransportError> {
    let mut conn = rustls::ClientConnection::new(config.clone(), server_name.clone())
        .map_err(|e| TransportError::Tls(e.to_string()))?;
    conn.set_buffer_limit(Some(TLS_BUFFER_BYTES));
    while conn.is_handshaking() {
        conn.complete_io(sock)
            .map_err(|e| TransportError::Tls(format!("handshake with the target: {e}")))?;
    }
    super::auth::initiator(&mut rustls::Stream::new(&mut conn, sock), pairing)?;
    Ok(conn)
}
