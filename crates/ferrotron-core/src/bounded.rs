//! Reading a file a user or a piece of data names: a regular file only (links are followed, then
//! what they lead to is checked: a device, a FIFO or a socket would block or never end), and no
//! more than a limit for its kind, checked before reading and enforced while reading (a file that
//! grows meanwhile is still cut off). Errors are `std::io::Error`s whose text says what was wrong
//! and what to do; callers add the path.

use std::io::{Error, ErrorKind, Read};
use std::path::Path;

const MIB: u64 = 1 << 20;
/// Lock files, `latest`, small settings.
pub const SMALL: u64 = MIB;
/// JSON and TOML settings: `config.json`, `adapter_config.json`, `run.toml`, manifests, host
/// files, shard indices.
pub const SETTINGS: u64 = 64 * MIB;
/// Tokenizers (`tokenizer.json` of large vocabularies is tens of MB).
pub const TOKENIZER: u64 = 512 * MIB;
/// Records a run appends to (`metrics.jsonl`), `--runs` files.
pub const RECORDS: u64 = 4 * 1024 * MIB;
/// Training text and token files, read whole into memory.
pub const CORPUS: u64 = 64 * 1024 * MIB;

/// What `path` leads to, when it is not a regular file.
fn not_regular(t: std::fs::FileType) -> Option<&'static str> {
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileTypeExt;
        if t.is_fifo() {
            return Some("a FIFO");
        }
        if t.is_char_device() || t.is_block_device() {
            return Some("a device");
        }
        if t.is_socket() {
            return Some("a socket");
        }
    }
    if t.is_dir() {
        return Some("a directory");
    }
    (!t.is_file()).then_some("not a regular file")
}

/// Opens `path` for reading once it is known to be a regular file of at most `limit` bytes; the
/// file and its length.
pub fn open(path: &Path, limit: u64) -> std::io::Result<(std::fs::File, u64)> {
    // Checked before opening: opening a FIFO with no writer blocks.
    let meta = std::fs::metadata(path)?;
    if let Some(what) = not_regular(meta.file_type()) {
        return Err(Error::new(
            ErrorKind::InvalidInput,
            format!("it is {what}, not a regular file: give a file"),
        ));
    }
    let file = std::fs::File::open(path)?;
    // And again on what was opened (the path may have been replaced in between).
    let meta = file.metadata()?;
    if let Some(what) = not_regular(meta.file_type()) {
        return Err(Error::new(
            ErrorKind::InvalidInput,
            format!("it is {what}, not a regular file: give a file"),
        ));
    }
    if meta.len() > limit {
        return Err(too_large(meta.len(), limit));
    }
    Ok((file, meta.len()))
}

fn too_large(len: u64, limit: u64) -> Error {
    Error::new(
        ErrorKind::InvalidInput,
        format!(
            "it is {} bytes, more than the {} bytes a file of this kind may be: is it the file you meant?",
            len, limit
        ),
    )
}

/// The bytes of `path`, a regular file of at most `limit` bytes.
pub fn read(path: &Path, limit: u64) -> std::io::Result<Vec<u8>> {
    let (file, len) = open(path, limit)?;
    let mut bytes = Vec::with_capacity(len as usize);
    file.take(limit + 1).read_to_end(&mut bytes)?;
    if bytes.len() as u64 > limit {
        return Err(too_large(bytes.len() as u64, limit));
    }
    Ok(bytes)
}

/// The text of `path`, a regular UTF-8 file of at most `limit` bytes.
pub fn read_to_string(path: &Path, limit: u64) -> std::io::Result<String> {
    String::from_utf8(read(path, limit)?)
        .map_err(|e| Error::new(ErrorKind::InvalidData, format!("it is not UTF-8 text: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn devices_fifos_directories_and_oversized_files_are_refused() {
        let dir = std::env::temp_dir().join(format!("ferrotron-bounded-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("a.json");
        std::fs::write(&f, "0123456789").unwrap();
        assert_eq!(read_to_string(&f, 10).unwrap(), "0123456789");
        let e = read(&f, 9).unwrap_err().to_string();
        assert!(e.contains("10 bytes, more than the 9"), "{e}");
        let e = read(&dir, SMALL).unwrap_err().to_string();
        assert!(e.contains("a directory"), "{e}");
        #[cfg(unix)]
        {
            let e = read(Path::new("/dev/zero"), SMALL).unwrap_err().to_string();
            assert!(e.contains("a device"), "{e}");
            // A link to a device: followed, then refused.
            let link = dir.join("zero.json");
            let _ = std::fs::remove_file(&link);
            std::os::unix::fs::symlink("/dev/zero", &link).unwrap();
            assert!(read(&link, SMALL)
                .unwrap_err()
                .to_string()
                .contains("a device"));
            // A FIFO with no writer: refused at once, never opened.
            let fifo = dir.join("fifo");
            let _ = std::fs::remove_file(&fifo);
            let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
            // SAFETY: a valid NUL-terminated path.
            assert_eq!(unsafe { libc_mkfifo(c.as_ptr(), 0o600) }, 0);
            assert!(read(&fifo, SMALL)
                .unwrap_err()
                .to_string()
                .contains("a FIFO"));
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[cfg(unix)]
    extern "C" {
        #[link_name = "mkfifo"]
        fn libc_mkfifo(path: *const std::ffi::c_char, mode: u32) -> i32;
    }
}
