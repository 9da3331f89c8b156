//! Layer files under the data dir: creating them durably, opening a chain
//! of them as [`Layer`]s, and cleaning up what a crash left behind.
//!
//! ```text
//! DATA_DIR/
//!   meta.redb                      metadata (redb)
//!   layers/<id as 16 hex>.data     sparse data file, one per layer
//!   layers/<id as 16 hex>.map      ownership map, for layers with a parent
//!   NAME                           a raw file dropped in by hand: adopted as a volume
//! ```

use super::catalog::{Catalog, LayerRec};
use super::faults::Faults;
use crate::backend::layered::map::{self, GranuleMap};
use crate::backend::layered::{Cow, Layer};
use crate::backend::{AnyBackend, Opener, file};
use crate::error::{CoronaError, Result};
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

pub const LAYERS_DIR: &str = "layers";

/// `layers/<id>.data`, relative to the data dir.
pub fn data_name(id: u64) -> String {
    format!("{LAYERS_DIR}/{id:016x}.data")
}

pub fn map_path(dir: &Path, id: u64) -> PathBuf {
    dir.join(LAYERS_DIR).join(format!("{id:016x}.map"))
}

pub fn sync_dir(dir: &Path) -> Result<()> {
    File::open(dir)?.sync_all()?;
    Ok(())
}

/// Creates the files of a new layer and makes them durable: an empty sparse
/// data file of `size` bytes and, if `with_map`, a map with no granule owned.
/// On failure nothing of the layer is left: a later change allocates the
/// same id again and must find the names free.
pub fn create_layer(dir: &Path, id: u64, size: u64, with_map: bool, faults: &Faults) -> Result<()> {
    // No record names a new id, so files under its name are strays of an
    // earlier failure whose cleanup failed too.
    remove_files(dir, id)?;
    let r = create_files(dir, id, size, with_map, faults);
    if r.is_err()
        && let Err(e) = remove_files(dir, id)
    {
        tracing::warn!(layer = id, error = %e, "cannot remove the files of a layer that failed to be created");
    }
    r.map_err(|e| too_large(e, size))
}

/// EFBIG from sizing a file means the file system cannot hold the volume.
pub fn too_large(e: CoronaError, size: u64) -> CoronaError {
    match e {
        CoronaError::Io(io) if io.raw_os_error() == Some(libc::EFBIG) => CoronaError::TooLarge { size },
        e => e,
    }
}

fn create_files(dir: &Path, id: u64, size: u64, with_map: bool, faults: &Faults) -> Result<()> {
    faults.check("create data file")?;
    let data = OpenOptions::new().write(true).create_new(true).open(dir.join(data_name(id)))?;
    faults.check("size data file")?;
    data.set_len(size)?;
    faults.check("sync data file")?;
    data.sync_all()?;
    if with_map {
        create_map(dir, id, size, faults)?;
    }
    faults.check("sync layers dir")?;
    sync_dir(&dir.join(LAYERS_DIR))
}

/// Removes a layer's data file and map if they exist.
fn remove_files(dir: &Path, id: u64) -> Result<()> {
    let mut removed = false;
    for p in [dir.join(data_name(id)), map_path(dir, id)] {
        match std::fs::remove_file(&p) {
            Ok(()) => removed = true,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(e.into()),
        }
    }
    if removed {
        sync_dir(&dir.join(LAYERS_DIR))?;
    }
    Ok(())
}

/// Grows a layer's data file (and map) to `size` ahead of the commit that
/// records the size, so a size the file system cannot hold fails before
/// anything is recorded. Extra length a failed commit leaves is invisible
/// and cut back when the layer opens ([`fit`]).
pub fn grow(dir: &Path, rec: &LayerRec, id: u64, size: u64, faults: &Faults) -> Result<()> {
    let f = OpenOptions::new().write(true).open(dir.join(&rec.file))?;
    if f.metadata()?.len() < size {
        faults.check("size data file")?;
        f.set_len(size).map_err(|e| too_large(e.into(), size))?;
        faults.check("sync data file")?;
        f.sync_all()?;
    }
    if rec.parent.is_some() {
        let m = OpenOptions::new().write(true).open(map_path(dir, id))?;
        let want = map::file_len(map::count(size));
        if m.metadata()?.len() < want {
            faults.check("write map")?;
            m.set_len(want)?;
            faults.check("sync map")?;
            m.sync_all()?;
        }
    }
    Ok(())
}

fn create_map(dir: &Path, id: u64, size: u64, faults: &Faults) -> Result<()> {
    faults.check("create map")?;
    let mut m = OpenOptions::new().write(true).create_new(true).open(map_path(dir, id))?;
    let g = map::count(size);
    faults.check("write map")?;
    m.write_all(&map::header(id, g))?;
    m.set_len(map::file_len(g))?;
    faults.check("sync map")?;
    m.sync_all()?;
    Ok(())
}

/// Makes a layer's data file `size` bytes long and its map big enough; a
/// resize interrupted by a crash is finished here.
pub fn fit(dir: &Path, rec: &LayerRec, id: u64) -> Result<()> {
    let f = OpenOptions::new().write(true).open(dir.join(&rec.file))?;
    if f.metadata()?.len() != rec.size {
        f.set_len(rec.size)?;
        f.sync_all()?;
    }
    if rec.parent.is_some() {
        let path = map_path(dir, id);
        let m = OpenOptions::new().write(true).open(&path)?;
        let want = map::file_len(map::count(rec.size));
        if m.metadata()?.len() < want {
            m.set_len(want)?;
            m.sync_all()?;
        }
    }
    Ok(())
}

/// Frees data in granules the map does not own (a copy cut short by a
/// crash), with plain syscalls before the file is handed to an engine.
fn reclaim(data: &File, map: &GranuleMap, size: u64) -> Result<u64> {
    let mut freed = 0;
    let mut pos = 0;
    while pos < size {
        let ext = file::seek_extents(data, pos, size - pos, 1024)?;
        if ext.is_empty() {
            break;
        }
        for e in ext {
            if e.flags & crate::proto::state::HOLE == 0 {
                let (g0, g1) = map::granules(pos, e.length);
                for g in (g0..=g1).filter(|&g| !map.owned(g)) {
                    let s = g * map::GRANULE;
                    file::zero_range(data, s, map::GRANULE.min(size - s), true, true)?;
                    freed += map::GRANULE.min(size - s);
                }
            }
            pos += e.length;
        }
    }
    if freed > 0 {
        data.sync_data()?;
    }
    Ok(freed)
}

/// Opens layer `id` of the catalog. Parents come from `parent` when given
/// (a head being replaced keeps its parents), else they are opened read-only.
pub fn open_layer(
    dir: &Path,
    opener: &Opener,
    cat: &Catalog,
    id: u64,
    writable: bool,
    parent: Option<Arc<Layer<AnyBackend>>>,
    faults: &Faults,
) -> Result<Layer<AnyBackend>> {
    faults.check("open layer")?;
    let rec = cat.layers.get(&id).ok_or_else(|| CoronaError::Meta(format!("layer {id} is missing")))?;
    if writable {
        fit(dir, rec, id)?;
    }
    let data = OpenOptions::new().read(true).write(writable).open(dir.join(&rec.file))?;
    let Some(pid) = rec.parent else {
        return Ok(Layer::base(id, rec.size, opener.open(data)?));
    };
    let parent = match parent {
        Some(p) => p,
        None => Arc::new(open_layer(dir, opener, cat, pid, false, None, faults)?),
    };
    let mfile = OpenOptions::new().read(true).write(writable).open(map_path(dir, id))?;
    let len = mfile.metadata()?.len();
    let mut bytes = vec![0; len as usize];
    mfile.read_exact_at(&mut bytes, 0)?;
    let granules = map::count(rec.size);
    let m = GranuleMap::from_bytes(&bytes, granules)?;
    if writable {
        let freed = reclaim(&data, &m, rec.size)?;
        if freed > 0 {
            tracing::info!(layer = id, freed, "reclaimed copies cut short by a crash");
        }
    }
    Ok(Layer {
        id,
        size: rec.size,
        data: opener.open(data)?,
        cow: Some(Cow { map: m, map_file: opener.open(mfile)?, parent, parent_limit: rec.parent_limit }),
    })
}

/// Deletes a layer's files (after its record is gone).
pub fn remove_layer(dir: &Path, id: u64, rec: &LayerRec) {
    for p in [dir.join(&rec.file), map_path(dir, id)] {
        match std::fs::remove_file(&p) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => tracing::warn!(path = %p.display(), error = %e, "cannot remove layer file"),
        }
    }
}

/// Removes files under `layers/` that no record names, and maps of layers
/// without a parent: what a crash between a commit and an unlink (or
/// between creating files and the commit) leaves. Returns what was removed.
pub fn remove_strays(dir: &Path, cat: &Catalog) -> Result<Vec<String>> {
    let mut removed = Vec::new();
    for entry in std::fs::read_dir(dir.join(LAYERS_DIR))? {
        let entry = entry?;
        let name = entry.file_name().to_string_lossy().into_owned();
        let keep = name
            .split_once('.')
            .and_then(|(id, ext)| Some((u64::from_str_radix(id, 16).ok()?, ext)))
            .and_then(|(id, ext)| Some((cat.layers.get(&id)?, ext)))
            .is_some_and(|(rec, ext)| match ext {
                "data" => true,
                "map" => rec.parent.is_some(),
                _ => false,
            });
        if !keep {
            std::fs::remove_file(entry.path())?;
            removed.push(name);
        }
    }
    if !removed.is_empty() {
        sync_dir(&dir.join(LAYERS_DIR))?;
    }
    Ok(removed)
}
