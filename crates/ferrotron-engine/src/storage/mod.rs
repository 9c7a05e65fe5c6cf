//! Where a model or a checkpoint lives: a local path, or an object under `s3://bucket/prefix` on
//! any S3-compatible store. Everything that reads or writes them goes through [`Location`], so a
//! path and a URL behave alike: read whole or a byte range, write (atomically), list, delete.

pub mod s3;

use crate::error::{EngineError, Result};
use s3::S3Path;
use std::fmt;
use std::io::{Read, Seek, SeekFrom};
use std::ops::Range;
use std::path::{Path, PathBuf};

/// A file or directory on this machine, or an object or prefix on an object store.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Location {
    Local(PathBuf),
    S3(S3Path),
}

impl fmt::Display for Location {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Location::Local(p) => write!(f, "{}", p.display()),
            Location::S3(p) => write!(f, "{p}"),
        }
    }
}

/// Whether `spec` names an object store location rather than a local path.
pub fn is_remote(spec: &str) -> bool {
    spec.starts_with("s3://")
}

/// One entry directly inside a directory or prefix.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Listed {
    /// Its name (a "directory" on an object store: a common prefix, without its trailing `/`).
    pub name: String,
    pub is_dir: bool,
}

impl Location {
    /// `s3://bucket/prefix`, or a local path.
    pub fn parse(spec: &str) -> Result<Self> {
        if is_remote(spec) {
            return Ok(Location::S3(S3Path::parse(spec)?));
        }
        if spec.contains("://") {
            return Err(EngineError::Invalid(format!(
                "`{spec}`: only local paths and s3:// URLs are supported"
            )));
        }
        Ok(Location::Local(PathBuf::from(spec)))
    }

    /// The local path, when this is one.
    pub fn local(&self) -> Option<&Path> {
        match self {
            Location::Local(p) => Some(p),
            Location::S3(_) => None,
        }
    }

    /// The entry `name` (a relative path of plain names) inside this directory or prefix.
    pub fn join(&self, name: &str) -> Self {
        match self {
            Location::Local(p) => Location::Local(p.join(name)),
            Location::S3(p) => Location::S3(p.join(name)),
        }
    }

    /// A path standing for this location in error messages (an S3 URL reads as itself).
    pub fn as_error_path(&self) -> PathBuf {
        PathBuf::from(self.to_string())
    }

    fn not_found(&self) -> EngineError {
        EngineError::io(
            self.as_error_path(),
            std::io::Error::new(std::io::ErrorKind::NotFound, "no such file or object"),
        )
    }

    /// The whole file, refused when larger than `limit` bytes.
    pub fn read(&self, limit: u64) -> Result<Vec<u8>> {
        self.try_read(limit)?.ok_or_else(|| self.not_found())
    }

    /// The whole file, `None` when there is none; refused when larger than `limit` bytes.
    pub fn try_read(&self, limit: u64) -> Result<Option<Vec<u8>>> {
        let bytes = match self {
            Location::Local(p) => match ferrotron_core::bounded::open(p, limit) {
                Ok((mut f, _)) => {
                    let mut v = Vec::new();
                    f.read_to_end(&mut v).map_err(|e| EngineError::io(p, e))?;
                    Some(v)
                }
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
                Err(e) => return Err(EngineError::io(p, e)),
            },
            Location::S3(p) => {
                if s3::size(p)?.is_some_and(|n| n > limit) {
                    return Err(EngineError::format(
                        self.as_error_path(),
                        format!("larger than the {limit} bytes such a file may have"),
                    ));
                }
                s3::get(p, None)?
            }
        };
        Ok(bytes)
    }

    /// The file's bytes `range`.
    pub fn read_range(&self, range: Range<u64>) -> Result<Vec<u8>> {
        match self {
            Location::Local(p) => {
                let mut f = std::fs::File::open(p).map_err(|e| EngineError::io(p, e))?;
                let mut buf = vec![0u8; (range.end - range.start) as usize];
                f.seek(SeekFrom::Start(range.start))
                    .and_then(|_| f.read_exact(&mut buf))
                    .map_err(|e| EngineError::io(p, e))?;
                Ok(buf)
            }
            Location::S3(p) => s3::get(p, Some(range))?.ok_or_else(|| self.not_found()),
        }
    }

    /// The file's size, `None` when there is none.
    pub fn size(&self) -> Result<Option<u64>> {
        match self {
            Location::Local(p) => match std::fs::metadata(p) {
                Ok(m) if m.is_file() => Ok(Some(m.len())),
                Ok(_) => Ok(None),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
                Err(e) => Err(EngineError::io(p, e)),
            },
            Location::S3(p) => s3::size(p),
        }
    }

    /// Whether a file (not a directory) is there.
    pub fn is_file(&self) -> Result<bool> {
        Ok(self.size()?.is_some())
    }

    /// Whether anything is there (locally also a directory, a device or a FIFO, which a reader
    /// then refuses by name).
    pub fn exists(&self) -> Result<bool> {
        match self {
            Location::Local(p) => Ok(p.exists()),
            Location::S3(p) => Ok(s3::size(p)?.is_some()),
        }
    }

    /// Replaces the file with `bytes`: a reader sees the old content or the new, never a part.
    pub fn write(&self, bytes: &[u8]) -> Result<()> {
        match self {
            Location::Local(p) => write_atomic(p, bytes),
            Location::S3(p) => s3::put(p, bytes),
        }
    }

    /// Copies the local file `from` here (large files in parts, never whole in memory).
    pub fn upload_file(&self, from: &Path) -> Result<()> {
        match self {
            Location::Local(p) => {
                let bytes = std::fs::read(from).map_err(|e| EngineError::io(from, e))?;
                write_atomic(p, &bytes)
            }
            Location::S3(p) => {
                let mut f = std::fs::File::open(from).map_err(|e| EngineError::io(from, e))?;
                let len = f.metadata().map_err(|e| EngineError::io(from, e))?.len();
                s3::upload(p, &mut f, len, s3::PART_BYTES)
            }
        }
    }

    /// The names directly inside this directory or prefix (none when it does not exist).
    pub fn list(&self) -> Result<Vec<Listed>> {
        match self {
            Location::Local(p) => {
                let Ok(entries) = std::fs::read_dir(p) else {
                    return Ok(Vec::new());
                };
                Ok(entries
                    .flatten()
                    .map(|e| Listed {
                        name: e.file_name().to_string_lossy().into_owned(),
                        is_dir: e.path().is_dir(),
                    })
                    .collect())
            }
            Location::S3(p) => s3::list(p),
        }
    }

    /// Deletes the file (nothing when there is none).
    pub fn remove(&self) -> Result<()> {
        match self {
            Location::Local(p) => unless_missing(p, std::fs::remove_file(p)),
            Location::S3(p) => s3::delete(p),
        }
    }

    /// Deletes the directory or prefix and all it holds.
    pub fn remove_all(&self) -> Result<()> {
        match self {
            Location::Local(p) => unless_missing(p, std::fs::remove_dir_all(p)),
            Location::S3(p) => s3::delete_all(p),
        }
    }

    /// Checks, before any work, that the location can be reached: on an object store the bucket
    /// exists and the credentials may use it.
    pub fn check_reachable(&self) -> Result<()> {
        match self {
            Location::Local(_) => Ok(()),
            Location::S3(p) => s3::check_bucket(p),
        }
    }
}

/// A deletion's outcome: done, or nothing was there.
fn unless_missing(p: &Path, r: std::io::Result<()>) -> Result<()> {
    match r {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(EngineError::io(p, e)),
        _ => Ok(()),
    }
}

/// Writes a file so that readers see either the old content or the complete new one.
pub fn write_atomic(file: &Path, bytes: &[u8]) -> Result<()> {
    // A name of this process's and this call's own: writers in other processes (MPI ranks) or
    // threads never share a temporary file.
    static CALLS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    // Hidden (`.name.PID-N.tmp`), so that a crash between write and rename leaves nothing a
    // reader or a person takes for the file.
    let name = file.file_name().and_then(|n| n.to_str()).unwrap_or("file");
    let tmp = file.with_file_name(format!(".{name}.{}-{n}.tmp", std::process::id()));
    std::fs::write(&tmp, bytes).map_err(|e| EngineError::io(&tmp, e))?;
    std::fs::File::open(&tmp)
        .and_then(|f| f.sync_all())
        .map_err(|e| EngineError::io(&tmp, e))?;
    std::fs::rename(&tmp, file).map_err(|e| EngineError::io(file, e))
}
