//! `gpumedic hooks verify|sign`: the repair webhook's signature from the receiver's side, so the
//! owners of a receiver can test it.
//!
//! `verify` reads one request as it arrived (the raw HTTP/1.1 request: request line, headers, an
//! empty line, the body) and checks it exactly as a receiver must, with the remediator's own
//! [`gpumedic_remediator::hooks::verify`]: a known key signed the key id, the timestamp and the
//! body, and the timestamp is within the tolerance. `sign` prints such a request, signed as the
//! remediator signs it, at now or at any time (an old one is a replay).

use std::io::{Read as _, Write as _};
use std::process::ExitCode;

use clap::{Args, Subcommand};
use gpumedic_remediator::hooks::{self, Key};
use gpumedic_runtime::config::{EXIT_CONFIG, Problems, parse_duration, render_problems};

/// Exit status of `verify` when the request could not be read or parsed (not a verdict on it).
const EXIT_UNREADABLE: u8 = 2;

/// `gpumedic hooks ...`.
#[derive(Debug, Subcommand)]
pub enum HooksCommand {
    /// Check a repair webhook request as a receiver must: prints `valid: key <id>, signed <age>
    /// ago` and exits 0, or `refused: <why>` and exits 1 (2: the request cannot be read or parsed;
    /// 64: bad flags).
    Verify(VerifyArgs),
    /// Print a repair webhook request (raw HTTP/1.1) with BODY signed as the remediator signs it,
    /// for a receiver's own tests; `--timestamp` in the past makes a replay it must refuse.
    Sign(SignArgs),
}

/// `gpumedic hooks verify`.
#[derive(Debug, Args)]
pub struct VerifyArgs {
    /// A key the receiver knows, as `ID=PATH` (the file holds the secret; trailing newlines are
    /// ignored). Repeat it for each key a receiver holds during a rotation.
    #[arg(
        long = "key-file",
        value_name = "ID=PATH",
        required = true,
        env = "GPUMEDIC_HOOKS_KEY_FILES",
        value_delimiter = ','
    )]
    key_files: Vec<String>,
    /// How far the signed timestamp may be from this machine's clock, either way, before the
    /// request is refused as a replay (or a clock problem).
    #[arg(long, env = "GPUMEDIC_HOOKS_TOLERANCE", default_value = "5m")]
    tolerance: String,
    /// The request as the receiver got it: the raw HTTP/1.1 request (request line optional,
    /// headers, an empty line, the body; CRLF or LF line ends). With Content-Length the body is
    /// that many bytes, else everything after the empty line. `-` reads stdin.
    #[arg(long, value_name = "FILE|-", env = "GPUMEDIC_HOOKS_REQUEST", default_value = "-")]
    request: String,
}

/// `gpumedic hooks sign`.
#[derive(Debug, Args)]
pub struct SignArgs {
    /// A key to sign with, as `ID=PATH`; the first is the current key. Give two to sign as the
    /// remediator does during a rotation.
    #[arg(
        long = "key-file",
        value_name = "ID=PATH",
        required = true,
        env = "GPUMEDIC_HOOKS_KEY_FILES",
        value_delimiter = ','
    )]
    key_files: Vec<String>,
    /// The body, sent byte for byte (`-` reads stdin).
    #[arg(long, value_name = "FILE|-", env = "GPUMEDIC_HOOKS_BODY", default_value = "-")]
    body: String,
    /// When it was signed, in Unix seconds (default: now).
    #[arg(long, env = "GPUMEDIC_HOOKS_TIMESTAMP", allow_hyphen_values = true)]
    timestamp: Option<i64>,
    /// The receiver's URL: the request line's path and the Host header.
    #[arg(long, env = "GPUMEDIC_HOOKS_URL", default_value = "https://localhost/")]
    url: String,
    /// The Idempotency-Key header (the remediator sends `<verdict id>:<step>`).
    #[arg(long, env = "GPUMEDIC_HOOKS_IDEMPOTENCY_KEY")]
    idempotency_key: Option<String>,
}

/// Why a dumped request cannot be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RequestError {
    /// A line of the header block is neither the request line nor `Name: value`.
    #[error("line {line} is not a header (`Name: value`): {text:?}")]
    NotAHeader {
        /// The line's number, from 1.
        line: usize,
        /// The line.
        text: String,
    },
    /// Content-Length is not a number.
    #[error("Content-Length {0:?} is not a number")]
    BadLength(String),
    /// The dump holds fewer bytes than Content-Length says.
    #[error("the body has {got} bytes but Content-Length says {want}: the dump is cut short")]
    ShortBody {
        /// Bytes after the empty line.
        got: usize,
        /// Content-Length.
        want: usize,
    },
    /// A chunked body, which would have to be decoded first.
    #[error("the body is chunked (Transfer-Encoding); dump the decoded body with a Content-Length instead")]
    Chunked,
}

/// A dumped request: its headers in order and its body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    /// `(name, value)`, values trimmed.
    pub headers: Vec<(String, String)>,
    /// The body bytes.
    pub body: Vec<u8>,
}

impl Request {
    /// Every value of header `name` (case-insensitive), joined with `,` as HTTP combines
    /// repeated headers; `None` when absent.
    pub fn header(&self, name: &str) -> Option<String> {
        let values: Vec<&str> =
            self.headers.iter().filter(|(n, _)| n.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str()).collect();
        (!values.is_empty()).then(|| values.join(","))
    }
}

/// Parses a raw HTTP/1.1 request: an optional request line (`POST /path HTTP/1.1`), header lines,
/// an empty line, the body (Content-Length bytes when given, else the rest). CRLF or LF.
pub fn parse_request(raw: &[u8]) -> Result<Request, RequestError> {
    let (head, rest) = match (find(raw, b"\r\n\r\n"), find(raw, b"\n\n")) {
        (Some(crlf), Some(lf)) if lf < crlf => (&raw[..lf], &raw[lf + 2..]),
        (Some(crlf), _) => (&raw[..crlf], &raw[crlf + 4..]),
        (None, Some(lf)) => (&raw[..lf], &raw[lf + 2..]),
        (None, None) => (raw, &raw[raw.len()..]),
    };
    let head = String::from_utf8_lossy(head);
    let mut headers = Vec::new();
    for (i, line) in head.split('\n').map(|l| l.trim_end_matches('\r')).enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        match line.split_once(':') {
            Some((name, value)) if !name.is_empty() && !name.contains(char::is_whitespace) => {
                headers.push((name.to_owned(), value.trim().to_owned()));
            }
            // The request line: `METHOD target HTTP/x`, first only.
            _ if i == 0 && line.split_whitespace().count() == 3 => {}
            _ => return Err(RequestError::NotAHeader { line: i + 1, text: line.to_owned() }),
        }
    }
    let request = Request { headers, body: Vec::new() };
    if request.header("transfer-encoding").is_some_and(|t| t.to_ascii_lowercase().contains("chunked")) {
        return Err(RequestError::Chunked);
    }
    let body = match request.header("content-length") {
        Some(raw) => {
            let want: usize = raw.trim().parse().map_err(|_| RequestError::BadLength(raw.clone()))?;
            rest.get(..want).ok_or(RequestError::ShortBody { got: rest.len(), want })?
        }
        None => rest,
    };
    Ok(Request { body: body.to_vec(), ..request })
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

/// Reads `--key-file ID=PATH` values into keys, recording every problem against `--key-file`.
fn keys(specs: &[String], p: &mut Problems) -> Vec<Key> {
    let mut keys: Vec<Key> = Vec::new();
    for spec in specs.iter().map(|s| s.trim()).filter(|s| !s.is_empty()) {
        let Some((id, path)) = spec.split_once('=') else {
            p.push("--key-file", format!("'{spec}' is not ID=PATH"));
            continue;
        };
        let key = hooks::read_secret(std::path::Path::new(path))
            .and_then(|secret| Key::new(id, secret).map_err(|e| format!("{spec}: {e}")));
        match key {
            Ok(k) if keys.iter().any(|known| known.id() == k.id()) => {
                p.push("--key-file", format!("{spec}: {}", hooks::KeyError::DuplicateId(id.to_owned())));
            }
            Ok(k) => keys.push(k),
            Err(e) => p.push("--key-file", e),
        }
    }
    if specs.iter().all(|s| s.trim().is_empty()) {
        p.push("--key-file", "give at least one key as ID=PATH");
    }
    keys
}

/// Reads FILE, or stdin for `-`.
fn read_input(what: &str) -> Result<Vec<u8>, String> {
    let mut bytes = Vec::new();
    if what == "-" {
        std::io::stdin().read_to_end(&mut bytes).map_err(|e| format!("cannot read stdin: {e}"))?;
    } else {
        bytes = std::fs::read(what).map_err(|e| format!("cannot read {what}: {e}"))?;
    }
    Ok(bytes)
}

/// Runs a `gpumedic hooks` subcommand.
pub fn run(command: HooksCommand) -> ExitCode {
    match command {
        HooksCommand::Verify(args) => verify(args),
        HooksCommand::Sign(args) => sign(args),
    }
}

fn verify(args: VerifyArgs) -> ExitCode {
    let mut p = Problems::default();
    let keys = keys(&args.key_files, &mut p);
    let tolerance = p.check("--tolerance", parse_duration(&args.tolerance));
    let Some(tolerance) = tolerance.filter(|_| p.list().is_empty()) else {
        eprint!("{}", render_problems("gpumedic hooks verify", &p));
        return ExitCode::from(EXIT_CONFIG);
    };
    let request = match read_input(&args.request).and_then(|raw| parse_request(&raw).map_err(|e| e.to_string())) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("gpumedic hooks verify: {e}");
            return ExitCode::from(EXIT_UNREADABLE);
        }
    };
    let (timestamp, key_ids, signatures) = (
        request.header(hooks::TIMESTAMP_HEADER),
        request.header(hooks::KEY_ID_HEADER),
        request.header(hooks::SIGNATURE_HEADER),
    );
    let delivery = hooks::Delivery {
        timestamp: timestamp.as_deref(),
        key_ids: key_ids.as_deref(),
        signatures: signatures.as_deref(),
        body: &request.body,
    };
    match hooks::verify(&delivery, &keys, tolerance, chrono::Utc::now().timestamp()) {
        Ok(v) if v.age_seconds < 0 => {
            println!(
                "valid: key {}, signed {} ahead of this clock",
                v.key_id,
                hooks::human_seconds(v.age_seconds.unsigned_abs())
            );
            ExitCode::SUCCESS
        }
        Ok(v) => {
            println!("valid: key {}, signed {} ago", v.key_id, hooks::human_seconds(v.age_seconds.unsigned_abs()));
            ExitCode::SUCCESS
        }
        Err(e) => {
            println!("refused: {e}");
            ExitCode::FAILURE
        }
    }
}

/// The raw request `sign` prints: CRLF line ends, the body byte for byte.
fn render_request(url: &reqwest::Url, headers: &[(&str, &str)], body: &[u8]) -> Vec<u8> {
    let mut target = url.path().to_owned();
    if let Some(q) = url.query() {
        target.push('?');
        target.push_str(q);
    }
    let host = match (url.host_str(), url.port()) {
        (Some(h), Some(port)) => format!("{h}:{port}"),
        (Some(h), None) => h.to_owned(),
        (None, _) => "localhost".to_owned(),
    };
    let mut out = format!("POST {target} HTTP/1.1\r\nHost: {host}\r\n");
    for (name, value) in headers {
        out.push_str(&format!("{name}: {value}\r\n"));
    }
    out.push_str(&format!("Content-Length: {}\r\n\r\n", body.len()));
    let mut out = out.into_bytes();
    out.extend_from_slice(body);
    out
}

fn sign(args: SignArgs) -> ExitCode {
    let mut p = Problems::default();
    let keys = keys(&args.key_files, &mut p);
    let url = p.check("--url", reqwest::Url::parse(&args.url).map_err(|e| format!("'{}' is not a URL: {e}", args.url)));
    let Some(url) = url.filter(|_| p.list().is_empty()) else {
        eprint!("{}", render_problems("gpumedic hooks sign", &p));
        return ExitCode::from(EXIT_CONFIG);
    };
    let body = match read_input(&args.body) {
        Ok(b) => b,
        Err(e) => {
            eprintln!("gpumedic hooks sign: {e}");
            return ExitCode::FAILURE;
        }
    };
    let signed = hooks::sign(&keys, args.timestamp.unwrap_or_else(|| chrono::Utc::now().timestamp()), &body);
    let mut headers = vec![("Content-Type", "application/json")];
    headers.extend(signed.pairs());
    if let Some(key) = &args.idempotency_key {
        headers.push((hooks::IDEMPOTENCY_HEADER, key.as_str()));
    }
    let out = render_request(&url, &headers, &body);
    let mut stdout = std::io::stdout().lock();
    match stdout.write_all(&out).and_then(|()| stdout.flush()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("gpumedic hooks sign: cannot write: {e}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_raw_request_with_crlf_and_content_length_parses_to_its_exact_body() {
        let raw = b"POST /v1/repair HTTP/1.1\r\nHost: x\r\nX-Gpumedic-Timestamp: 17\r\n\
                    x-gpumedic-key-id:  a \r\nContent-Length: 7\r\n\r\n{\"a\":1}\n";
        let r = parse_request(raw).unwrap();
        assert_eq!(r.body, b"{\"a\":1}", "the editor's trailing newline is past Content-Length");
        assert_eq!(r.header("X-GPUMEDIC-TIMESTAMP").as_deref(), Some("17"));
        assert_eq!(r.header("X-Gpumedic-Key-Id").as_deref(), Some("a"));
        assert_eq!(r.header("X-Gpumedic-Signature"), None);
    }

    #[test]
    fn lf_headers_without_a_request_line_or_length_keep_the_rest_as_the_body() {
        let r = parse_request(b"X-Gpumedic-Signature: v1=aa\nX-Gpumedic-Signature: v1=bb\n\nbody\n\nmore").unwrap();
        assert_eq!(r.header("x-gpumedic-signature").as_deref(), Some("v1=aa,v1=bb"), "repeated headers combine");
        assert_eq!(r.body, b"body\n\nmore");
        assert_eq!(parse_request(b"").unwrap(), Request { headers: vec![], body: vec![] });
    }

    #[test]
    fn a_dump_that_is_not_a_request_says_why() {
        assert_eq!(
            parse_request(b"Host: x\nnot a header\n\n"),
            Err(RequestError::NotAHeader { line: 2, text: "not a header".into() })
        );
        assert_eq!(
            parse_request(b"Content-Length: 10\r\n\r\nshort"),
            Err(RequestError::ShortBody { got: 5, want: 10 })
        );
        assert_eq!(parse_request(b"Content-Length: ten\n\n"), Err(RequestError::BadLength("ten".into())));
        assert_eq!(parse_request(b"Transfer-Encoding: chunked\n\n5\r\nhello\r\n0\r\n\r\n"), Err(RequestError::Chunked));
    }

    #[test]
    fn a_signed_request_reads_back_as_it_was_signed() {
        let key = Key::new("k-1", hooks::Secret(b"Jefe".to_vec())).unwrap();
        let signed = hooks::sign(std::slice::from_ref(&key), 1_700_000_000, b"{\"a\":1}");
        let url = reqwest::Url::parse("https://repair.example.com:8443/v1/repair?x=1").unwrap();
        let raw = render_request(&url, &signed.pairs(), b"{\"a\":1}");
        assert!(raw.starts_with(b"POST /v1/repair?x=1 HTTP/1.1\r\nHost: repair.example.com:8443\r\n"));
        let r = parse_request(&raw).unwrap();
        let (t, k, s) =
            (r.header(hooks::TIMESTAMP_HEADER), r.header(hooks::KEY_ID_HEADER), r.header(hooks::SIGNATURE_HEADER));
        let delivery =
            hooks::Delivery { timestamp: t.as_deref(), key_ids: k.as_deref(), signatures: s.as_deref(), body: &r.body };
        let ok = hooks::verify(&delivery, &[key], std::time::Duration::from_secs(300), 1_700_000_010).unwrap();
        assert_eq!(ok.key_id, "k-1");
    }
}
