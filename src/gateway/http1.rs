//! The HTTP/1.1 client for plain `http://` gateways: keep-alive connections
//! in a pool, one request per connection at a time, and nothing held for a
//! request that waits on its answer but the socket and the request's own
//! future.
//!
//! Why not hyper's pooled client (which reqwest wraps, and which still
//! serves `https://` and HTTP/2 gateways): HTTP/1.1 needs one connection
//! per request in flight, and each of hyper's client connections holds an
//! 8 KiB read buffer reserved before the answer comes, an 8 KiB write
//! buffer, a 9 KiB dispatch channel and a spawned task (heaptrack of a
//! held request, issue 21): 10 000 held requests cost 310 MiB. Here the
//! request's head is written from a buffer dropped once sent, and the read
//! buffer is allocated only when the socket becomes readable.
//!
//! What it speaks: `POST` with a `Content-Length` body; answers framed by
//! `Content-Length`, chunked transfer coding (extensions and trailers
//! skipped) or the connection's end; interim 1xx answers skipped. A
//! connection goes back to the pool only after a complete HTTP/1.1 answer
//! without `Connection: close`. Proxy environment variables are not used:
//! the gateway is the pool's own front, reached directly.

use std::collections::{HashMap, VecDeque};
use std::io;
use std::sync::Mutex;
use std::time::Duration;

use bytes::Bytes;
use reqwest::Url;
use reqwest::header::{CONNECTION, CONTENT_LENGTH, HeaderMap, HeaderName, HeaderValue, USER_AGENT};
use tokio::io::AsyncReadExt;
use tokio::net::TcpStream;
use tokio::time::Instant;

use super::client::BodyTap;

/// Longest answer head (status line and headers) read; a longer one is a
/// protocol error, as it is for hyper.
const MAX_HEAD_BYTES: usize = 64 * 1024;
/// Most headers an answer may carry.
const MAX_HEADERS: usize = 100;
/// Read granularity once an answer is arriving.
const READ_CHUNK: usize = 8 * 1024;
/// A request body up to this size is copied behind its head and sent in
/// one write (one packet with `TCP_NODELAY`); a larger one is written
/// from the shared bytes without a copy.
const COALESCE_BODY_BYTES: usize = 16 * 1024;

/// The answer of one exchange (this client's or reqwest's): status,
/// headers and the body read up to the limit.
pub(super) struct Answer {
    pub(super) status: u16,
    pub(super) headers: HeaderMap,
    pub(super) body: Body,
}

/// A response body read up to the limit.
pub(super) enum Body {
    /// The whole body, within the limit.
    Complete(Vec<u8>),
    /// The first bytes (up to the limit) of a longer body; empty when a
    /// success declared a length over the limit, which is not read.
    TooLarge(Vec<u8>),
    /// What arrived before reading failed, and why it failed.
    Broken(Vec<u8>, String),
}

impl Body {
    pub(super) fn into_bytes(self) -> Vec<u8> {
        match self {
            Self::Complete(bytes) | Self::TooLarge(bytes) | Self::Broken(bytes, _) => bytes,
        }
    }
}

/// Why an exchange produced no answer head.
#[derive(Debug)]
pub(super) enum ExchangeError {
    /// No connection could be made.
    Connect(String),
    /// The connection broke, or the answer was not HTTP/1.1, before its
    /// head was complete.
    Reset(String),
    /// The request cannot be sent (a URL without a host).
    Request(String),
}

/// Where a connection goes: host and port as the URL gives them.
#[derive(Clone, PartialEq, Eq, Hash)]
struct Origin {
    host: String,
    port: u16,
}

/// An open connection waiting in the pool.
struct Idle {
    stream: TcpStream,
    since: Instant,
}

/// The pooled HTTP/1.1 client. Cheap to share behind the gateway client's
/// `Arc`.
pub(super) struct Http1Client {
    idle: Mutex<HashMap<Origin, VecDeque<Idle>>>,
    max_idle_per_host: usize,
    idle_timeout: Duration,
    connect_timeout: Duration,
    user_agent: HeaderValue,
}

impl Http1Client {
    pub(super) fn new(
        max_idle_per_host: usize,
        idle_timeout: Duration,
        connect_timeout: Duration,
        user_agent: &'static str,
    ) -> Self {
        Self {
            idle: Mutex::new(HashMap::new()),
            max_idle_per_host,
            idle_timeout,
            connect_timeout,
            user_agent: HeaderValue::from_static(user_agent),
        }
    }

    /// Posts `body` to `url` and reads the answer, its body up to `limit`
    /// bytes. A success (2xx) declaring a longer body is not read at all.
    ///
    /// A pooled connection the server closed while it was idle can fail
    /// before any answer byte arrives (the keep-alive race every HTTP/1.1
    /// client meets); such an exchange is made once more on a new
    /// connection, so a stale socket never costs the request an attempt.
    pub(super) async fn post<T: BodyTap>(
        &self,
        url: &Url,
        headers: &HeaderMap,
        body: &Bytes,
        limit: usize,
        tap: &mut T,
    ) -> Result<Answer, ExchangeError> {
        let origin = origin(url)?;
        let head = request_head(url, &origin, headers, body.len(), &self.user_agent);
        if let Some(stream) = self.checkout(&origin) {
            // A stale connection fails before any answer byte, so before
            // the tap saw anything: the exchange made again starts clean.
            match exchange(stream, &head, body, limit, tap).await {
                Err(Exchange::Stale(_)) => {}
                other => return self.finish(origin, other),
            }
        }
        let stream = self.connect(&origin).await?;
        let result = exchange(stream, &head, body, limit, tap).await;
        self.finish(origin, result)
    }

    /// Keeps a reusable connection and turns the exchange into its answer.
    fn finish(
        &self,
        origin: Origin,
        result: Result<(Answer, Option<TcpStream>), Exchange>,
    ) -> Result<Answer, ExchangeError> {
        match result {
            Ok((answer, reusable)) => {
                if let Some(stream) = reusable {
                    self.checkin(origin, stream);
                }
                Ok(answer)
            }
            Err(Exchange::Stale(reason) | Exchange::Broken(reason)) => {
                Err(ExchangeError::Reset(reason))
            }
        }
    }

    /// The most recently used live connection to `origin`, if any. Idle
    /// connections past the idle timeout, and any the server has closed
    /// (readable while no request is out: an end of stream or stray
    /// bytes), are dropped on the way.
    fn checkout(&self, origin: &Origin) -> Option<TcpStream> {
        let mut idle = self.idle.lock().unwrap_or_else(|p| p.into_inner());
        let waiting = idle.get_mut(origin)?;
        let now = Instant::now();
        while let Some(conn) = waiting.pop_back() {
            if now.duration_since(conn.since) < self.idle_timeout && is_quiet(&conn.stream) {
                return Some(conn.stream);
            }
        }
        None
    }

    /// Puts a connection back for the next request, dropping connections
    /// idle past the timeout from the old end so a pool that shrank does
    /// not keep their sockets open.
    fn checkin(&self, origin: Origin, stream: TcpStream) {
        if self.max_idle_per_host == 0 {
            return;
        }
        let mut idle = self.idle.lock().unwrap_or_else(|p| p.into_inner());
        let waiting = idle.entry(origin).or_default();
        let now = Instant::now();
        while waiting
            .front()
            .is_some_and(|oldest| now.duration_since(oldest.since) >= self.idle_timeout)
        {
            waiting.pop_front();
        }
        if waiting.len() < self.max_idle_per_host {
            waiting.push_back(Idle { stream, since: now });
        }
    }

    async fn connect(&self, origin: &Origin) -> Result<TcpStream, ExchangeError> {
        let connecting = TcpStream::connect((origin.host.as_str(), origin.port));
        let stream = match tokio::time::timeout(self.connect_timeout, connecting).await {
            Ok(Ok(stream)) => stream,
            Ok(Err(error)) => return Err(ExchangeError::Connect(error.to_string())),
            Err(_) => return Err(ExchangeError::Connect("connect timed out".into())),
        };
        // Requests are single writes waiting on an answer: Nagle's delay
        // would only add latency.
        stream
            .set_nodelay(true)
            .map_err(|error| ExchangeError::Connect(error.to_string()))?;
        Ok(stream)
    }
}

fn origin(url: &Url) -> Result<Origin, ExchangeError> {
    let host = url
        .host_str()
        .ok_or_else(|| ExchangeError::Request("the gateway URL has no host".into()))?;
    // `host_str` brackets an IPv6 address, which the resolver does not take.
    let host = host
        .trim_start_matches('[')
        .trim_end_matches(']')
        .to_owned();
    let port = url
        .port_or_known_default()
        .ok_or_else(|| ExchangeError::Request("the gateway URL has no port".into()))?;
    Ok(Origin { host, port })
}

/// Whether an idle connection has nothing to read: the server has not
/// closed it and sent nothing unasked.
fn is_quiet(stream: &TcpStream) -> bool {
    let mut probe = [0u8; 1];
    matches!(stream.try_read(&mut probe), Err(e) if e.kind() == io::ErrorKind::WouldBlock)
}

/// The request line and headers. `Host`, `Content-Length` and (unless the
/// caller set one) `User-Agent` are added here; the caller's headers never
/// carry framing headers (`target.rs` refuses them).
fn request_head(
    url: &Url,
    origin: &Origin,
    headers: &HeaderMap,
    body_len: usize,
    user_agent: &HeaderValue,
) -> Vec<u8> {
    let mut head = Vec::with_capacity(256 + headers.len() * 48);
    head.extend_from_slice(b"POST ");
    head.extend_from_slice(url.path().as_bytes());
    if let Some(query) = url.query() {
        head.push(b'?');
        head.extend_from_slice(query.as_bytes());
    }
    head.extend_from_slice(b" HTTP/1.1\r\nhost: ");
    head.extend_from_slice(url.host_str().unwrap_or(&origin.host).as_bytes());
    if url.port().is_some() {
        head.extend_from_slice(format!(":{}", origin.port).as_bytes());
    }
    head.extend_from_slice(b"\r\n");
    let mut line = |name: &HeaderName, value: &HeaderValue| {
        head.extend_from_slice(name.as_str().as_bytes());
        head.extend_from_slice(b": ");
        head.extend_from_slice(value.as_bytes());
        head.extend_from_slice(b"\r\n");
    };
    for (name, value) in headers {
        line(name, value);
    }
    if !headers.contains_key(USER_AGENT) {
        line(&USER_AGENT, user_agent);
    }
    line(&CONTENT_LENGTH, &HeaderValue::from(body_len));
    head.extend_from_slice(b"\r\n");
    head
}

/// How an exchange failed before its answer head was complete.
enum Exchange {
    /// Closed or reset before the first answer byte: on a pooled
    /// connection, the server most likely closed it while idle.
    Stale(String),
    /// Broke after the answer began, or the answer was not HTTP/1.x.
    Broken(String),
}

/// One request and its answer on `stream`. Gives the stream back when the
/// answer was complete and the connection may be reused.
async fn exchange<T: BodyTap>(
    mut stream: TcpStream,
    head: &[u8],
    body: &Bytes,
    limit: usize,
    tap: &mut T,
) -> Result<(Answer, Option<TcpStream>), Exchange> {
    let (mut buf, request_complete, send_error) = match send_request(&stream, head, body).await {
        Sent::Whole => (Vec::new(), true, None),
        Sent::Answered(early) => (early, false, None),
        // The gateway may have answered before it closed: read what came.
        Sent::Failed(error) => (Vec::new(), false, Some(error.to_string())),
    };
    if buf.is_empty() && send_error.is_none() {
        // Wait without a buffer: a request held for minutes keeps only its
        // socket.
        stream
            .readable()
            .await
            .map_err(|error| Exchange::Stale(error.to_string()))?;
    }
    // Whether any answer byte came: a connection that closes before one
    // may have been closed by the server while idle (stale).
    let mut answered = !buf.is_empty();
    let parsed = loop {
        // Interim answers (100 Continue, 103 Early Hints) come before the
        // final one and are skipped.
        let mut found = None;
        while let Some(head) = parse_head(&buf)? {
            if head.status >= 200 {
                found = Some(head);
                break;
            }
            buf.drain(..head.len);
        }
        if let Some(head) = found {
            break head;
        }
        if buf.len() > MAX_HEAD_BYTES {
            return Err(Exchange::Broken(format!(
                "answer head longer than {MAX_HEAD_BYTES} bytes"
            )));
        }
        let read = fill(&mut stream, &mut buf).await.map_err(|error| {
            broken_or_stale(answered, send_error.clone().unwrap_or(error.to_string()))
        })?;
        if read == 0 {
            let reason = send_error.clone().unwrap_or_else(|| {
                "connection closed before the answer's head was complete".into()
            });
            return Err(broken_or_stale(answered, reason));
        }
        answered = true;
    };
    buf.drain(..parsed.len);
    let framing = framing(&parsed)?;
    let success = (200..300).contains(&parsed.status);
    // Only a success's body is tapped (the relay streams answers, not
    // errors).
    let tap = success.then_some(tap);
    let (body, complete) = match framing {
        Framing::Empty => (Body::Complete(Vec::new()), true),
        Framing::Length(length) if success && length > limit as u64 => {
            (Body::TooLarge(Vec::new()), false)
        }
        Framing::Length(length) => read_length(&mut stream, buf, length, limit, tap).await,
        Framing::Chunked => read_chunked(&mut stream, buf, limit, tap).await,
        Framing::UntilClose => {
            let (body, _) = read_until_close(&mut stream, buf, limit, tap).await;
            (body, false)
        }
    };
    let reusable = (request_complete && complete && parsed.keep_alive).then_some(stream);
    Ok((
        Answer {
            status: parsed.status,
            headers: parsed.headers,
            body,
        },
        reusable,
    ))
}

/// How sending a request ended.
enum Sent {
    /// Every byte went out.
    Whole,
    /// The gateway answered (or closed) before the request was all sent:
    /// what it sent so far. A gateway may refuse early (a 413, or a 429
    /// from the endpoint picker) without reading a large body; waiting to
    /// write all of it first would wait until the attempt times out.
    Answered(Vec<u8>),
    /// Writing failed.
    Failed(io::Error),
}

/// Writes the request's head and body while watching the socket for an
/// early answer.
async fn send_request(stream: &TcpStream, head: &[u8], body: &[u8]) -> Sent {
    let coalesced;
    let parts: [&[u8]; 2] = if body.len() <= COALESCE_BODY_BYTES {
        coalesced = [head, body].concat();
        [&coalesced, &[]]
    } else {
        [head, body]
    };
    for part in parts {
        let mut at = 0;
        while at < part.len() {
            match stream.try_write(&part[at..]) {
                Ok(0) => return Sent::Failed(io::ErrorKind::WriteZero.into()),
                Ok(written) => at += written,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    tokio::select! {
                        biased;
                        ready = stream.readable() => {
                            if let Err(error) = ready {
                                return Sent::Failed(error);
                            }
                            let mut early = Vec::with_capacity(READ_CHUNK);
                            match stream.try_read_buf(&mut early) {
                                Ok(_) => return Sent::Answered(early),
                                // Readiness can be spurious: keep writing.
                                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                                Err(error) => return Sent::Failed(error),
                            }
                        }
                        ready = stream.writable() => {
                            if let Err(error) = ready {
                                return Sent::Failed(error);
                            }
                        }
                    }
                }
                Err(error) => return Sent::Failed(error),
            }
        }
    }
    Sent::Whole
}

fn broken_or_stale(answered: bool, reason: String) -> Exchange {
    if answered {
        Exchange::Broken(reason)
    } else {
        Exchange::Stale(reason)
    }
}

/// Reads what is available into `buf`'s spare room; 0 at the end of the
/// stream.
async fn fill(stream: &mut TcpStream, buf: &mut Vec<u8>) -> io::Result<usize> {
    if buf.capacity() - buf.len() < READ_CHUNK / 2 {
        buf.reserve(READ_CHUNK);
    }
    stream.read_buf(buf).await
}

/// An answer head: status, headers, what framing needs, and its length in
/// the buffer.
struct Head {
    status: u16,
    headers: HeaderMap,
    keep_alive: bool,
    len: usize,
}

/// Parses the head at the start of `buf`; `None` while it is incomplete.
fn parse_head(buf: &[u8]) -> Result<Option<Head>, Exchange> {
    let mut slots = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut response = httparse::Response::new(&mut slots);
    let len = match response.parse(buf) {
        Ok(httparse::Status::Complete(len)) => len,
        Ok(httparse::Status::Partial) => return Ok(None),
        Err(error) => return Err(Exchange::Broken(format!("invalid answer head: {error}"))),
    };
    let status = response.code.unwrap_or_default();
    let mut headers = HeaderMap::with_capacity(response.headers.len());
    for header in response.headers.iter() {
        let name = HeaderName::from_bytes(header.name.as_bytes());
        let value = HeaderValue::from_bytes(header.value);
        if let (Ok(name), Ok(value)) = (name, value) {
            headers.append(name, value);
        }
    }
    // HTTP/1.0 closes by default; HTTP/1.1 keeps alive unless told not to.
    let keep_alive = response.version == Some(1) && !has_token(&headers, &CONNECTION, "close");
    Ok(Some(Head {
        status,
        headers,
        keep_alive,
        len,
    }))
}

fn has_token(headers: &HeaderMap, name: &HeaderName, token: &str) -> bool {
    headers.get_all(name).iter().any(|value| {
        value.to_str().is_ok_and(|text| {
            text.split(',')
                .any(|item| item.trim().eq_ignore_ascii_case(token))
        })
    })
}

/// How the answer's body is delimited (RFC 9112, section 6.3).
enum Framing {
    Empty,
    Length(u64),
    Chunked,
    UntilClose,
}

fn framing(head: &Head) -> Result<Framing, Exchange> {
    if head.status == 204 || head.status == 304 {
        return Ok(Framing::Empty);
    }
    let codings = head.headers.get_all(reqwest::header::TRANSFER_ENCODING);
    if codings.iter().next().is_some() {
        let last_is_chunked = codings
            .iter()
            .filter_map(|value| value.to_str().ok())
            .flat_map(|text| text.split(','))
            .map(str::trim)
            .rfind(|coding| !coding.is_empty())
            .is_some_and(|coding| coding.eq_ignore_ascii_case("chunked"));
        return Ok(if last_is_chunked {
            Framing::Chunked
        } else {
            Framing::UntilClose
        });
    }
    let mut length = None;
    for value in head.headers.get_all(CONTENT_LENGTH) {
        let parsed = value
            .to_str()
            .ok()
            .and_then(|text| text.trim().parse::<u64>().ok())
            .ok_or_else(|| Exchange::Broken("invalid Content-Length".into()))?;
        if length.is_some_and(|seen| seen != parsed) {
            return Err(Exchange::Broken("conflicting Content-Length values".into()));
        }
        length = Some(parsed);
    }
    Ok(length.map_or(Framing::UntilClose, Framing::Length))
}

/// Reads a body of `length` bytes of which `buf` holds the start. Returns
/// the body and whether the connection ended clean (the whole body read).
async fn read_length<T: BodyTap>(
    stream: &mut TcpStream,
    mut buf: Vec<u8>,
    length: u64,
    limit: usize,
    mut tap: Option<&mut T>,
) -> (Body, bool) {
    let keep = usize::try_from(length).map_or(limit, |length| length.min(limit));
    let mut tapped = 0;
    feed(&mut tap, &buf, &mut tapped, keep);
    if buf.len() >= keep {
        let complete = keep as u64 == length && buf.len() == keep;
        buf.truncate(keep);
        let body = if (keep as u64) < length {
            Body::TooLarge(buf)
        } else {
            Body::Complete(buf)
        };
        return (body, complete);
    }
    buf.reserve_exact(keep - buf.len());
    while buf.len() < keep {
        match stream.read_buf(&mut buf).await {
            Ok(0) => {
                let reason = format!(
                    "connection closed after {} of {length} body bytes",
                    buf.len()
                );
                return (Body::Broken(buf, reason), false);
            }
            Ok(_) => feed(&mut tap, &buf, &mut tapped, keep),
            Err(error) => return (Body::Broken(buf, error.to_string()), false),
        }
    }
    buf.truncate(keep);
    if (keep as u64) < length {
        (Body::TooLarge(buf), false)
    } else {
        (Body::Complete(buf), true)
    }
}

/// Hands the bytes of `body` after `tapped` (up to `limit`) to the tap.
fn feed<T: BodyTap>(tap: &mut Option<&mut T>, body: &[u8], tapped: &mut usize, limit: usize) {
    let end = body.len().min(limit);
    if let Some(tap) = tap
        && end > *tapped
    {
        tap.bytes(&body[*tapped..end]);
        *tapped = end;
    }
}

/// Reads until the server closes the connection.
async fn read_until_close<T: BodyTap>(
    stream: &mut TcpStream,
    mut buf: Vec<u8>,
    limit: usize,
    mut tap: Option<&mut T>,
) -> (Body, bool) {
    let mut tapped = 0;
    loop {
        feed(&mut tap, &buf, &mut tapped, limit);
        if buf.len() > limit {
            buf.truncate(limit);
            return (Body::TooLarge(buf), false);
        }
        match fill(stream, &mut buf).await {
            Ok(0) if buf.len() > limit => {}
            Ok(0) => return (Body::Complete(buf), false),
            Ok(_) => {}
            Err(error) => return (Body::Broken(buf, error.to_string()), false),
        }
    }
}

/// Decodes a chunked body of which `raw` holds the start, keeping at most
/// `limit` bytes of it.
async fn read_chunked<T: BodyTap>(
    stream: &mut TcpStream,
    mut raw: Vec<u8>,
    limit: usize,
    mut tap: Option<&mut T>,
) -> (Body, bool) {
    let mut body = Vec::new();
    let mut decoder = Chunked::default();
    let mut tapped = 0;
    loop {
        let done = decoder.decode(&mut raw, &mut body);
        feed(&mut tap, &body, &mut tapped, limit);
        if body.len() > limit {
            body.truncate(limit);
            return (Body::TooLarge(body), false);
        }
        match done {
            Ok(true) => return (Body::Complete(body), true),
            Ok(false) => {}
            Err(reason) => return (Body::Broken(body, reason), false),
        }
        match fill(stream, &mut raw).await {
            Ok(0) => {
                let reason = "connection closed inside a chunked body".to_owned();
                return (Body::Broken(body, reason), false);
            }
            Ok(_) => {}
            Err(error) => return (Body::Broken(body, error.to_string()), false),
        }
    }
}

/// Where the chunked decoder is between reads.
#[derive(Default)]
enum Chunked {
    /// Expecting a chunk-size line.
    #[default]
    Size,
    /// Inside a chunk's data, this many bytes left.
    Data(u64),
    /// Expecting the CRLF after a chunk's data.
    DataEnd,
    /// After the last chunk: trailer lines until an empty one.
    Trailers,
}

impl Chunked {
    /// Moves what `raw` holds into `body`, consuming it from `raw`. True
    /// once the body's end (the empty line after the last chunk) was read.
    fn decode(&mut self, raw: &mut Vec<u8>, body: &mut Vec<u8>) -> Result<bool, String> {
        let mut at = 0;
        let done = loop {
            let rest = &raw[at..];
            match *self {
                Self::Size => match httparse::parse_chunk_size(rest) {
                    Ok(httparse::Status::Complete((used, 0))) => {
                        at += used;
                        *self = Self::Trailers;
                    }
                    Ok(httparse::Status::Complete((used, size))) => {
                        at += used;
                        *self = Self::Data(size);
                    }
                    Ok(httparse::Status::Partial) => break false,
                    Err(_) => return Err("invalid chunk size line".into()),
                },
                Self::Data(left) => {
                    if rest.is_empty() {
                        break false;
                    }
                    let take = usize::try_from(left).map_or(rest.len(), |l| l.min(rest.len()));
                    body.extend_from_slice(&rest[..take]);
                    at += take;
                    let left = left - take as u64;
                    *self = if left == 0 {
                        Self::DataEnd
                    } else {
                        Self::Data(left)
                    };
                }
                Self::DataEnd => match rest {
                    [b'\r', b'\n', ..] => {
                        at += 2;
                        *self = Self::Size;
                    }
                    [] | [b'\r'] => break false,
                    _ => return Err("chunk data not followed by CRLF".into()),
                },
                Self::Trailers => match rest.windows(2).position(|pair| pair == b"\r\n") {
                    Some(0) => {
                        at += 2;
                        break true;
                    }
                    Some(end) => at += end + 2,
                    None => break false,
                },
            }
        };
        raw.drain(..at);
        Ok(done)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decode_all(pieces: &[&[u8]]) -> Result<(Vec<u8>, bool), String> {
        let (mut decoder, mut raw, mut body) = (Chunked::default(), Vec::new(), Vec::new());
        let mut done = false;
        for piece in pieces {
            raw.extend_from_slice(piece);
            done = decoder.decode(&mut raw, &mut body)?;
        }
        Ok((body, done))
    }

    #[test]
    fn chunked_bodies_decode_across_any_split() {
        let wire = b"5;ext=1\r\nhello\r\n7\r\n, world\r\n0\r\nx-trailer: 1\r\n\r\n";
        for split in 0..wire.len() {
            let (body, done) = decode_all(&[&wire[..split], &wire[split..]]).expect("valid");
            assert_eq!(body, b"hello, world", "split at {split}");
            assert!(done, "split at {split}");
        }
        let (body, done) = decode_all(&[b"5\r\nhel"]).expect("partial");
        assert_eq!((body.as_slice(), done), (&b"hel"[..], false));
    }

    #[test]
    fn malformed_chunks_are_errors() {
        assert!(decode_all(&[b"zz\r\n"]).is_err());
        assert!(decode_all(&[b"2\r\nabXY"]).is_err());
    }

    fn head(text: &str) -> Head {
        match parse_head(text.as_bytes()) {
            Ok(Some(head)) => head,
            _ => panic!("a complete head: {text:?}"),
        }
    }

    #[test]
    fn framing_follows_the_rfc_order() {
        let length = head("HTTP/1.1 200 OK\r\ncontent-length: 12\r\n\r\n");
        assert!(matches!(framing(&length), Ok(Framing::Length(12))));
        let chunked = head(
            "HTTP/1.1 200 OK\r\ntransfer-encoding: gzip, chunked\r\ncontent-length: 3\r\n\r\n",
        );
        assert!(matches!(framing(&chunked), Ok(Framing::Chunked)));
        let unframed = head("HTTP/1.1 200 OK\r\n\r\n");
        assert!(matches!(framing(&unframed), Ok(Framing::UntilClose)));
        let no_content = head("HTTP/1.1 204 No Content\r\ncontent-length: 5\r\n\r\n");
        assert!(matches!(framing(&no_content), Ok(Framing::Empty)));
        let conflicting = head("HTTP/1.1 200 OK\r\ncontent-length: 1\r\ncontent-length: 2\r\n\r\n");
        assert!(framing(&conflicting).is_err());
    }

    #[test]
    fn only_http_1_1_without_close_keeps_the_connection() {
        assert!(head("HTTP/1.1 200 OK\r\n\r\n").keep_alive);
        assert!(!head("HTTP/1.1 200 OK\r\nConnection: keep-alive, Close\r\n\r\n").keep_alive);
        assert!(!head("HTTP/1.0 200 OK\r\n\r\n").keep_alive);
        assert!(matches!(
            parse_head(b"HTTP/1.1 200 OK\r\ncontent-"),
            Ok(None)
        ));
        assert!(parse_head(b"SSH-2.0-OpenSSH\r\n\r\n").is_err());
    }

    #[test]
    fn the_request_head_names_the_origin_and_the_length() {
        let url = Url::parse("http://gw:8080/v1/completions?x=1").expect("url");
        let origin = origin(&url).expect("origin");
        let mut headers = HeaderMap::new();
        headers.insert("content-type", HeaderValue::from_static("application/json"));
        let head = request_head(&url, &origin, &headers, 42, &HeaderValue::from_static("ua"));
        assert_eq!(
            String::from_utf8(head).expect("ascii"),
            "POST /v1/completions?x=1 HTTP/1.1\r\nhost: gw:8080\r\ncontent-type: application/json\r\nuser-agent: ua\r\ncontent-length: 42\r\n\r\n"
        );
        let v6 = Url::parse("http://[::1]/v1").expect("url");
        assert_eq!(origin_of(&v6), ("::1".to_owned(), 80));
    }

    fn origin_of(url: &Url) -> (String, u16) {
        let origin = origin(url).expect("origin");
        (origin.host, origin.port)
    }
}
