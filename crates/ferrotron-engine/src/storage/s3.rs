//! An S3-compatible object store, spoken to directly: requests are signed by `rusty-s3` (presigned
//! URLs, SigV4) and sent by `ureq` (blocking HTTP with keep-alive), so no async runtime is pulled in.
//!
//! Configured the way the AWS tools are: `AWS_ENDPOINT_URL` (default: AWS itself in `AWS_REGION`),
//! `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY` (and `AWS_SESSION_TOKEN`), `AWS_REGION` (or
//! `AWS_DEFAULT_REGION`; default `us-east-1`) and `AWS_ALLOW_HTTP=true` for a plain-HTTP endpoint.
//! Transient failures (no connection, 5xx, throttling) are retried with exponential backoff; what
//! is left is an error naming the URL and what to check.

use super::Listed;
use crate::error::{EngineError, Result};
use rusty_s3::actions::{CreateMultipartUpload, ListObjectsV2};
use rusty_s3::{Bucket, Credentials, S3Action, UrlStyle};
use std::fmt;
use std::io::Read;
use std::ops::Range;
use std::sync::OnceLock;
use std::time::Duration;

/// An object (or, with a key ending in a name, a prefix) `s3://bucket/key`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct S3Path {
    pub bucket: String,
    /// No leading or trailing `/`; empty for the bucket's root.
    pub key: String,
}

impl fmt::Display for S3Path {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.key.is_empty() {
            write!(f, "s3://{}", self.bucket)
        } else {
            write!(f, "s3://{}/{}", self.bucket, self.key)
        }
    }
}

impl S3Path {
    /// `s3://bucket/key…` (the `s3://` already recognised by the caller).
    pub fn parse(url: &str) -> Result<Self> {
        let rest = url.strip_prefix("s3://").unwrap_or(url);
        let (bucket, key) = rest.split_once('/').unwrap_or((rest, ""));
        let valid_bucket = (3..=63).contains(&bucket.len())
            && bucket
                .chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '.');
        if !valid_bucket {
            return Err(EngineError::Invalid(format!(
                "`{url}`: `{bucket}` is not a bucket name (3 to 63 lower-case letters, digits, `-` or `.`); write s3://BUCKET/PREFIX"
            )));
        }
        let key = key.trim_end_matches('/');
        if key.split('/').any(|part| part == ".." || part == ".")
            || key.contains("//")
            || key.starts_with('/')
        {
            return Err(EngineError::Invalid(format!(
                "`{url}`: the key `{key}` has an empty, `.` or `..` part; write s3://BUCKET/PREFIX with plain names"
            )));
        }
        Ok(Self {
            bucket: bucket.to_string(),
            key: key.to_string(),
        })
    }

    /// The object `name` under this prefix.
    pub fn join(&self, name: &str) -> Self {
        let name = name.trim_matches('/');
        Self {
            bucket: self.bucket.clone(),
            key: if self.key.is_empty() {
                name.to_string()
            } else {
                format!("{}/{name}", self.key)
            },
        }
    }

    /// The key as a listing prefix: empty, or ending in `/`.
    fn dir_prefix(&self) -> String {
        if self.key.is_empty() {
            String::new()
        } else {
            format!("{}/", self.key)
        }
    }
}

/// Where requests go and with what credentials, read from the environment.
struct Endpoint {
    url: url::Url,
    region: String,
    credentials: Option<Credentials>,
}

impl Endpoint {
    fn from_env(about: &S3Path) -> Result<Self> {
        let var = |k: &str| std::env::var(k).ok().filter(|v| !v.trim().is_empty());
        let region = var("AWS_REGION")
            .or_else(|| var("AWS_DEFAULT_REGION"))
            .unwrap_or_else(|| "us-east-1".to_string());
        let text =
            var("AWS_ENDPOINT_URL").unwrap_or_else(|| format!("https://s3.{region}.amazonaws.com"));
        let url = url::Url::parse(&text).map_err(|e| {
            storage_error(
                about,
                format!("AWS_ENDPOINT_URL `{text}` is not a URL ({e}); write e.g. http://127.0.0.1:9000"),
            )
        })?;
        let allow_http = var("AWS_ALLOW_HTTP").is_some_and(|v| v == "true" || v == "1");
        if url.scheme() == "http" && !allow_http {
            return Err(storage_error(
                about,
                format!("the endpoint {text} is plain HTTP: set AWS_ALLOW_HTTP=true to use it (credentials and data then travel unencrypted)"),
            ));
        }
        let credentials = match (var("AWS_ACCESS_KEY_ID"), var("AWS_SECRET_ACCESS_KEY")) {
            (Some(key), Some(secret)) => Some(match var("AWS_SESSION_TOKEN") {
                Some(token) => Credentials::new_with_token(key, secret, token),
                None => Credentials::new(key, secret),
            }),
            (None, None) => None,
            _ => {
                return Err(storage_error(
                    about,
                    "only one of AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY is set: set both (or neither, for a public bucket)",
                ))
            }
        };
        Ok(Self {
            url,
            region,
            credentials,
        })
    }

    fn bucket(&self, p: &S3Path) -> Result<Bucket> {
        Bucket::new(
            self.url.clone(),
            UrlStyle::Path,
            p.bucket.clone(),
            self.region.clone(),
        )
        .map_err(|e| storage_error(p, format!("endpoint {}: {e}", self.url)))
    }
}

fn storage_error(p: &S3Path, msg: impl Into<String>) -> EngineError {
    EngineError::Storage {
        location: p.to_string(),
        msg: msg.into(),
    }
}

/// One HTTP agent for the process: its connections are kept alive between requests (a rank reads
/// many small ranges of one file).
fn agent() -> &'static ureq::Agent {
    static AGENT: OnceLock<ureq::Agent> = OnceLock::new();
    AGENT.get_or_init(|| {
        ureq::Agent::config_builder()
            .http_status_as_error(false)
            .timeout_connect(Some(Duration::from_secs(10)))
            .timeout_recv_response(Some(Duration::from_secs(120)))
            // A body that stops arriving is an error (retried), never a hang.
            .timeout_recv_body(Some(Duration::from_secs(600)))
            .max_idle_connections_per_host(16)
            .build()
            .into()
    })
}

/// How long a signed request stays valid (it is sent at once; retries sign anew).
const SIGNED_FOR: Duration = Duration::from_secs(600);
/// Tries per request, and the first wait between them (doubled each time): 0.2 + 0.4 + 0.8 + 1.6
/// + 3.2 s in all before a request is given up.
const TRIES: u32 = 6;
const FIRST_BACKOFF: Duration = Duration::from_millis(200);
/// Objects larger than this are uploaded in parts of this size (S3 takes at most 5 GiB in one
/// request and parts of at least 5 MiB).
pub const PART_BYTES: usize = 64 << 20;

/// A response: status, its `ETag`, body.
struct Reply {
    status: u16,
    etag: Option<String>,
    body: Vec<u8>,
}

/// Sends one request (built afresh for each try by `send`), retrying transient failures.
fn with_retries(
    p: &S3Path,
    what: &str,
    mut send: impl FnMut() -> std::result::Result<ureq::http::Response<ureq::Body>, ureq::Error>,
) -> Result<Reply> {
    let mut wait = FIRST_BACKOFF;
    let mut last = String::new();
    for attempt in 1..=TRIES {
        match send() {
            Ok(mut r) => {
                let status = r.status().as_u16();
                let etag = r
                    .headers()
                    .get("etag")
                    .and_then(|v| v.to_str().ok())
                    .map(str::to_string);
                let body = r.body_mut().with_config().limit(u64::MAX).read_to_vec();
                match body {
                    Ok(body) if !(status >= 500 || status == 429) => {
                        return Ok(Reply { status, etag, body })
                    }
                    Ok(body) => {
                        last = format!("the server answered {status} ({})", error_code(&body))
                    }
                    Err(e) => last = format!("the response broke off ({e})"),
                }
            }
            Err(e) => last = e.to_string(),
        }
        if attempt < TRIES {
            std::thread::sleep(wait);
            wait *= 2;
        }
    }
    let endpoint = std::env::var("AWS_ENDPOINT_URL").unwrap_or_else(|_| "AWS S3".to_string());
    Err(storage_error(
        p,
        format!(
            "{what} failed {TRIES} times, the last: {last}. Is the endpoint {endpoint} (AWS_ENDPOINT_URL) up and reachable?"
        ),
    ))
}

/// The `<Code>` of an S3 error body, or the body's start.
fn error_code(body: &[u8]) -> String {
    let text = String::from_utf8_lossy(body);
    match (text.find("<Code>"), text.find("</Code>")) {
        (Some(a), Some(b)) if a + 6 <= b => text[a + 6..b].to_string(),
        _ => text.chars().take(120).collect(),
    }
}

/// An error answer (4xx) as a message that says what to do; `None` for "no such key".
fn refusal(p: &S3Path, what: &str, reply: &Reply) -> Option<EngineError> {
    let code = error_code(&reply.body);
    let msg = match (reply.status, code.as_str()) {
        (404, "NoSuchKey") | (404, "") => return None,
        (404, "NoSuchBucket") => format!(
            "{what}: the bucket `{}` does not exist at this endpoint: create it, or correct the URL",
            p.bucket
        ),
        (403, _) | (401, _) => format!(
            "{what}: access denied ({code}): check AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, and that they may use the bucket `{}`",
            p.bucket
        ),
        (s, c) => format!("{what}: the server refused with {s} ({c})"),
    };
    Some(storage_error(p, msg))
}

fn check(p: &S3Path, what: &str, reply: Reply) -> Result<Option<Reply>> {
    if (200..300).contains(&reply.status) {
        return Ok(Some(reply));
    }
    match refusal(p, what, &reply) {
        Some(e) => Err(e),
        None => Ok(None),
    }
}

/// The object's bytes (`range`: only those), or `None` when there is no such object.
pub fn get(p: &S3Path, range: Option<Range<u64>>) -> Result<Option<Vec<u8>>> {
    let ep = Endpoint::from_env(p)?;
    let bucket = ep.bucket(p)?;
    let what = match &range {
        Some(r) => format!("reading bytes {}..{}", r.start, r.end),
        None => "reading".to_string(),
    };
    if range.as_ref().is_some_and(|r| r.is_empty()) {
        return Ok(Some(Vec::new()));
    }
    let reply = with_retries(p, &what, || {
        let url = bucket
            .get_object(ep.credentials.as_ref(), &p.key)
            .sign(SIGNED_FOR);
        let req = agent().get(url.as_str());
        match &range {
            Some(r) => req
                .header("Range", format!("bytes={}-{}", r.start, r.end - 1))
                .call(),
            None => req.call(),
        }
    })?;
    let Some(reply) = check(p, &what, reply)? else {
        return Ok(None);
    };
    if let Some(r) = &range {
        if reply.body.len() as u64 != r.end - r.start {
            return Err(storage_error(
                p,
                format!(
                    "{what}: the server sent {} bytes for a range of {} (the object is shorter than its header says?)",
                    reply.body.len(),
                    r.end - r.start
                ),
            ));
        }
    }
    Ok(Some(reply.body))
}

/// The object's size, or `None` when there is no such object.
pub fn size(p: &S3Path) -> Result<Option<u64>> {
    let ep = Endpoint::from_env(p)?;
    let bucket = ep.bucket(p)?;
    let mut length = None;
    let reply = with_retries(p, "looking up", || {
        let url = bucket
            .head_object(ep.credentials.as_ref(), &p.key)
            .sign(SIGNED_FOR);
        let r = agent().head(url.as_str()).call();
        if let Ok(r) = &r {
            length = r
                .headers()
                .get("content-length")
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.parse::<u64>().ok());
        }
        r
    })?;
    // A HEAD answer has no body to name the error: a missing bucket is found by `check_bucket`.
    Ok(check(p, "looking up", reply)?.and(length))
}

/// Checks that the bucket exists and the credentials may use it (before any work is done).
pub fn check_bucket(p: &S3Path) -> Result<()> {
    let ep = Endpoint::from_env(p)?;
    let bucket = ep.bucket(p)?;
    let reply = with_retries(p, "opening the bucket", || {
        let mut list = ListObjectsV2::new(&bucket, ep.credentials.as_ref());
        list.with_max_keys(1);
        agent().get(list.sign(SIGNED_FOR).as_str()).call()
    })?;
    if check(p, "opening the bucket", reply)?.is_none() {
        return Err(storage_error(
            p,
            format!(
                "the bucket `{}` does not exist at this endpoint: create it, or correct the URL",
                p.bucket
            ),
        ));
    }
    Ok(())
}

/// Writes the object (a whole replacement: readers see the old object or the new one).
pub fn put(p: &S3Path, bytes: &[u8]) -> Result<()> {
    upload(
        p,
        &mut std::io::Cursor::new(bytes),
        bytes.len() as u64,
        PART_BYTES,
    )
}

/// Writes the object from `len` bytes of `from`, in one request, or (larger than `part_bytes`) in
/// parts of that size: S3 shows the object only once the upload completes, whole.
pub fn upload(p: &S3Path, from: &mut dyn Read, len: u64, part_bytes: usize) -> Result<()> {
    let ep = Endpoint::from_env(p)?;
    let bucket = ep.bucket(p)?;
    let creds = ep.credentials.as_ref();
    let read_part = |from: &mut dyn Read, n: usize| -> Result<Vec<u8>> {
        let mut buf = vec![0u8; n];
        from.read_exact(&mut buf)
            .map_err(|e| storage_error(p, format!("reading what to upload: {e}")))?;
        Ok(buf)
    };
    if len <= part_bytes as u64 {
        let body = read_part(from, len as usize)?;
        let reply = with_retries(p, "writing", || {
            let url = bucket.put_object(creds, &p.key).sign(SIGNED_FOR);
            agent().put(url.as_str()).send(&body[..])
        })?;
        return check_written(p, "writing", reply);
    }
    let reply = with_retries(p, "starting an upload", || {
        let url = bucket
            .create_multipart_upload(creds, &p.key)
            .sign(SIGNED_FOR);
        agent().post(url.as_str()).send_empty()
    })?;
    let Some(reply) = check(p, "starting an upload", reply)? else {
        return Err(storage_error(
            p,
            "starting an upload: the server answered 404",
        ));
    };
    let created = CreateMultipartUpload::parse_response(&String::from_utf8_lossy(&reply.body))
        .map_err(|e| storage_error(p, format!("starting an upload: an unreadable answer ({e})")))?;
    let id = created.upload_id().to_string();
    let parts = (|| -> Result<Vec<String>> {
        let mut etags = Vec::new();
        let mut left = len;
        while left > 0 {
            let n = left.min(part_bytes as u64) as usize;
            let body = read_part(from, n)?;
            let number = u16::try_from(etags.len() + 1).map_err(|_| {
                storage_error(
                    p,
                    "more than 65535 parts: the object is too large to upload",
                )
            })?;
            let what = format!("uploading part {number}");
            let reply = with_retries(p, &what, || {
                let url = bucket
                    .upload_part(creds, &p.key, number, &id)
                    .sign(SIGNED_FOR);
                agent().put(url.as_str()).send(&body[..])
            })?;
            let reply = check(p, &what, reply)?
                .ok_or_else(|| storage_error(p, format!("{what}: the server answered 404")))?;
            etags.push(reply.etag.unwrap_or_default());
            left -= n as u64;
        }
        Ok(etags)
    })();
    let finished = parts.and_then(|etags| {
        let reply = with_retries(p, "completing an upload", || {
            let action = bucket.complete_multipart_upload(
                creds,
                &p.key,
                &id,
                etags.iter().map(String::as_str),
            );
            let url = action.sign(SIGNED_FOR);
            agent().post(url.as_str()).send(action.body())
        })?;
        check_written(p, "completing an upload", reply)
    });
    if finished.is_err() {
        // Best effort: an upload that never completes is invisible, but its parts take space.
        let url = bucket
            .abort_multipart_upload(creds, &p.key, &id)
            .sign(SIGNED_FOR);
        let _ = agent().delete(url.as_str()).call();
    }
    finished
}

fn check_written(p: &S3Path, what: &str, reply: Reply) -> Result<()> {
    match check(p, what, reply)? {
        Some(_) => Ok(()),
        None => Err(storage_error(p, format!("{what}: the server answered 404"))),
    }
}

/// The objects and "directories" directly under the prefix `p`.
pub fn list(p: &S3Path) -> Result<Vec<Listed>> {
    let ep = Endpoint::from_env(p)?;
    let bucket = ep.bucket(p)?;
    let prefix = p.dir_prefix();
    let mut out = Vec::new();
    let mut token: Option<String> = None;
    loop {
        let reply = with_retries(p, "listing", || {
            let mut list = ListObjectsV2::new(&bucket, ep.credentials.as_ref());
            list.with_prefix(prefix.as_str());
            list.with_delimiter("/");
            if let Some(t) = &token {
                list.with_continuation_token(t.as_str());
            }
            agent().get(list.sign(SIGNED_FOR).as_str()).call()
        })?;
        let Some(reply) = check(p, "listing", reply)? else {
            return Err(storage_error(
                p,
                format!("listing: the bucket `{}` does not exist", p.bucket),
            ));
        };
        let parsed = ListObjectsV2::parse_response(&String::from_utf8_lossy(&reply.body))
            .map_err(|e| storage_error(p, format!("listing: an unreadable answer ({e})")))?;
        let strip = |k: &str| k.strip_prefix(prefix.as_str()).unwrap_or(k).to_string();
        out.extend(parsed.contents.iter().map(|c| Listed {
            name: strip(&c.key),
            is_dir: false,
        }));
        out.extend(parsed.common_prefixes.iter().map(|c| Listed {
            name: strip(c.prefix.trim_end_matches('/')),
            is_dir: true,
        }));
        match parsed.next_continuation_token {
            Some(t) => token = Some(t),
            None => break,
        }
    }
    out.retain(|l| !l.name.is_empty());
    Ok(out)
}

/// Deletes the object (nothing when there is none).
pub fn delete(p: &S3Path) -> Result<()> {
    let ep = Endpoint::from_env(p)?;
    let bucket = ep.bucket(p)?;
    let reply = with_retries(p, "deleting", || {
        let url = bucket
            .delete_object(ep.credentials.as_ref(), &p.key)
            .sign(SIGNED_FOR);
        agent().delete(url.as_str()).call()
    })?;
    check(p, "deleting", reply).map(|_| ())
}

/// Deletes every object under the prefix `p`.
pub fn delete_all(p: &S3Path) -> Result<()> {
    for entry in list(p)? {
        let below = p.join(&entry.name);
        if entry.is_dir {
            delete_all(&below)?;
        } else {
            delete(&below)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_parse_into_bucket_and_key_and_bad_ones_are_refused() {
        let p = S3Path::parse("s3://models/llama/3.2-1b/").unwrap();
        assert_eq!(
            (p.bucket.as_str(), p.key.as_str()),
            ("models", "llama/3.2-1b")
        );
        assert_eq!(
            p.join("config.json").to_string(),
            "s3://models/llama/3.2-1b/config.json"
        );
        assert_eq!(S3Path::parse("s3://models").unwrap().join("a").key, "a");
        for bad in [
            "s3://",
            "s3://A_B/x",
            "s3://ok-bucket/a/../b",
            "s3://ok-bucket//x",
        ] {
            assert!(S3Path::parse(bad).is_err(), "{bad}");
        }
    }
}
