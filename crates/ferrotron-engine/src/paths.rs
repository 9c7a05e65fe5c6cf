//! Files named by untrusted data (a checkpoint's manifest and `latest`, a model's shard index) must
//! lie inside the directory that names them: a checkpoint or a model is data, never a way to reach
//! elsewhere on disk.

use crate::error::{EngineError, Result};
use std::path::{Component, Path, PathBuf};

/// `dir/name`, when `name` is a relative path of plain components that stays inside `dir` (also
/// after following symbolic links, when it exists). `source` is the file that named it, for the
/// error.
pub fn contained(dir: &Path, name: &str, source: &Path) -> Result<PathBuf> {
    let refuse = |why: &str| {
        EngineError::format(
            source,
            format!(
                "names the file `{name}`, {why}: every file it names must lie inside {}",
                dir.display()
            ),
        )
    };
    if name.is_empty() {
        return Err(refuse("an empty name"));
    }
    let plain = Path::new(name)
        .components()
        .all(|c| matches!(c, Component::Normal(_)));
    if !plain {
        return Err(refuse("which leaves its directory"));
    }
    let path = dir.join(name);
    if let (Ok(real), Ok(root)) = (path.canonicalize(), dir.canonicalize()) {
        if !real.starts_with(&root) {
            return Err(refuse("a link that leads out of its directory"));
        }
    }
    Ok(path)
}

/// Checks that `name` is a relative path of plain components (on an object store, where there is
/// nothing to follow, that is all [`contained`] needs). `source` is the file that named it.
pub fn plain_name(name: &str, source: &Path) -> Result<()> {
    let plain = !name.is_empty()
        && Path::new(name)
            .components()
            .all(|c| matches!(c, Component::Normal(_)));
    if plain {
        Ok(())
    } else {
        Err(EngineError::format(
            source,
            format!(
                "names the file `{name}`, which is not a plain relative name inside its directory"
            ),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_plain_relative_names_inside_the_directory_are_accepted() {
        let dir = std::env::temp_dir().join(format!("ferrotron-paths-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("sub")).unwrap();
        let src = dir.join("manifest.json");
        assert_eq!(contained(&dir, "a.bin", &src).unwrap(), dir.join("a.bin"));
        assert!(contained(&dir, "sub/a.bin", &src).is_ok());
        for bad in ["", "../x", "sub/../../x", "/etc/passwd", "./../x"] {
            let e = contained(&dir, bad, &src).unwrap_err().to_string();
            assert!(e.contains("must lie inside"), "{bad}: {e}");
        }
        #[cfg(unix)]
        {
            let link = dir.join("out");
            let _ = std::fs::remove_file(&link);
            std::os::unix::fs::symlink(std::env::temp_dir(), &link).unwrap();
            let e = contained(&dir, "out", &src).unwrap_err().to_string();
            assert!(e.contains("link"), "{e}");
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}
