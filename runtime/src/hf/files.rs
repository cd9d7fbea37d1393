//! A Hugging Face checkpoint folder on disk: `config.json` plus
//! `model.safetensors`, or shards listed by `model.safetensors.index.json`.
//!
//! Reading parses only the headers up front (a published model is tens of
//! gigabytes) and reads a tensor's bytes when asked. Nothing in a folder is
//! trusted: headers and the index are read with size caps, shard names
//! must be plain names inside the folder, and every tensor's byte range is
//! checked against its dtype, shape and file. Writing builds the whole
//! folder under a temporary name beside the target and renames it into
//! place, so a folder with the target's name is always complete.

use super::config::HfDtype;
use crate::checkpoint::durable;
use crate::error::{Result, RuntimeError};
use crate::tensor_file::Header;
use serde_json::{Map, Value, json};
use std::collections::BTreeMap;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

pub const CONFIG: &str = "config.json";
pub const SINGLE: &str = "model.safetensors";
pub const INDEX: &str = "model.safetensors.index.json";
/// transformers' default `max_shard_size` ("5GB"): a larger export is
/// sharded with an index.
pub const SHARD_BYTES: u64 = 5_000_000_000;
/// The largest `config.json` or index read (a published index is a few
/// hundred kilobytes).
const MAX_JSON_BYTES: u64 = 64 << 20;
/// The dtypes hybridgen reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StoredDtype {
    F32,
    Bf16,
    F16,
}

impl StoredDtype {
    fn size(self) -> usize {
        match self {
            StoredDtype::F32 => 4,
            StoredDtype::Bf16 | StoredDtype::F16 => 2,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            StoredDtype::F32 => "F32",
            StoredDtype::Bf16 => "BF16",
            StoredDtype::F16 => "F16",
        }
    }
}

/// Where one tensor's bytes are.
#[derive(Clone, Debug)]
pub struct StoredTensor {
    pub file: PathBuf,
    pub dtype: StoredDtype,
    pub shape: Vec<usize>,
    /// Absolute byte offset in `file`.
    offset: u64,
}

impl StoredTensor {
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// An opened folder: its config and where every tensor is.
#[derive(Debug)]
pub struct HfFolder {
    pub dir: PathBuf,
    pub config: Value,
    pub tensors: BTreeMap<String, StoredTensor>,
}

fn io(path: &Path, e: impl std::fmt::Display) -> RuntimeError {
    RuntimeError::io(path.display(), e)
}

/// The text of `path`, refused past `limit` bytes.
fn read_capped(path: &Path, limit: u64) -> Result<Vec<u8>> {
    let file = std::fs::File::open(path).map_err(|e| io(path, e))?;
    let mut bytes = Vec::new();
    file.take(limit + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| io(path, e))?;
    if bytes.len() as u64 > limit {
        return Err(io(path, format!("larger than the {limit}-byte limit")));
    }
    Ok(bytes)
}

fn read_json(path: &Path) -> Result<Value> {
    let bytes = read_capped(path, MAX_JSON_BYTES)?;
    let text = String::from_utf8(bytes).map_err(|e| io(path, format!("not UTF-8 text: {e}")))?;
    serde_json::from_str(&quote_python_floats(&text))
        .map_err(|e| io(path, format!("not valid JSON: {e}")))
}

/// `text` with the bare `Infinity`, `-Infinity` and `NaN` that Python's
/// `json` writes (transformers saves `time_step_limit` as `[0.0, Infinity]`)
/// turned into strings, which JSON can hold; strings are left alone.
pub fn quote_python_floats(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let (mut in_string, mut escaped) = (false, false);
    let mut rest = text;
    while let Some(c) = rest.chars().next() {
        if in_string {
            if escaped {
                escaped = false;
            } else if c == '\\' {
                escaped = true;
            } else if c == '"' {
                in_string = false;
            }
        } else if c == '"' {
            in_string = true;
        } else if let Some(word) = ["-Infinity", "Infinity", "NaN"]
            .into_iter()
            .find(|w| rest.starts_with(w))
        {
            out.push('"');
            out.push_str(word);
            out.push('"');
            rest = &rest[word.len()..];
            continue;
        }
        out.push(c);
        rest = &rest[c.len_utf8()..];
    }
    out
}

impl HfFolder {
    /// Opens `dir`: reads `config.json` and every safetensors header.
    pub fn open(dir: &Path) -> Result<Self> {
        if !dir.is_dir() {
            return Err(io(
                dir,
                if dir.exists() {
                    "not a directory; give the folder holding config.json and the safetensors"
                } else {
                    "no such directory"
                },
            ));
        }
        let config = read_json(&dir.join(CONFIG))?;
        let files = shard_files(dir)?;
        let mut tensors = BTreeMap::new();
        for (file, listed) in files {
            for (name, tensor) in read_header(&file)? {
                if let Some(listed) = &listed
                    && !listed.contains(&name)
                {
                    return Err(io(
                        &file,
                        format!(
                            "holds tensor `{name}`, which {INDEX} places in another file or not at all"
                        ),
                    ));
                }
                if tensors.insert(name.clone(), tensor).is_some() {
                    return Err(io(&file, format!("tensor `{name}` is stored twice")));
                }
            }
            if let Some(listed) = listed
                && let Some(absent) = listed.iter().find(|n| !tensors.contains_key(*n))
            {
                return Err(io(
                    &file,
                    format!("{INDEX} places tensor `{absent}` in this file, but it is not there"),
                ));
            }
        }
        Ok(HfFolder {
            dir: dir.to_path_buf(),
            config,
            tensors,
        })
    }

    /// Tensor `name`'s elements as f32 (bf16 and f16 widen exactly).
    pub fn read_f32(&self, name: &str) -> Result<Vec<f32>> {
        let t = self
            .tensors
            .get(name)
            .ok_or_else(|| io(&self.dir, format!("no tensor `{name}`")))?;
        let mut bytes = vec![0u8; t.numel() * t.dtype.size()];
        let mut file = std::fs::File::open(&t.file).map_err(|e| io(&t.file, e))?;
        file.seek(SeekFrom::Start(t.offset))
            .and_then(|_| file.read_exact(&mut bytes))
            .map_err(|e| io(&t.file, format!("reading `{name}`: {e}")))?;
        Ok(match t.dtype {
            StoredDtype::F32 => bytes
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
            StoredDtype::Bf16 => bytes
                .chunks_exact(2)
                .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            StoredDtype::F16 => bytes
                .chunks_exact(2)
                .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
        })
    }
}

/// The folder's safetensors files, each with the tensors the index places
/// in it (`None` for a lone `model.safetensors`).
fn shard_files(dir: &Path) -> Result<Vec<(PathBuf, Option<Vec<String>>)>> {
    let index = dir.join(INDEX);
    if !index.exists() {
        let single = dir.join(SINGLE);
        if !single.exists() {
            return Err(io(
                dir,
                format!("holds neither {SINGLE} nor {INDEX}: there are no weights to read"),
            ));
        }
        return Ok(vec![(single, None)]);
    }
    let value = read_json(&index)?;
    let Some(map) = value.get("weight_map").and_then(Value::as_object) else {
        return Err(io(&index, "has no `weight_map` object"));
    };
    let mut by_file: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for (tensor, file) in map {
        let Some(file) = file.as_str() else {
            return Err(io(
                &index,
                format!("`weight_map` gives {file} for `{tensor}`, not a file name"),
            ));
        };
        let plain = Path::new(file)
            .file_name()
            .is_some_and(|n| n == file && file != ".." && file != ".");
        if !plain {
            return Err(io(
                &index,
                format!("`{file}` (for `{tensor}`) is not a plain file name inside the folder"),
            ));
        }
        by_file
            .entry(file.to_string())
            .or_default()
            .push(tensor.clone());
    }
    Ok(by_file
        .into_iter()
        .map(|(file, tensors)| (dir.join(file), Some(tensors)))
        .collect())
}

/// The tensors of one safetensors file, checked against its length.
fn read_header(path: &Path) -> Result<Vec<(String, StoredTensor)>> {
    let mut file = std::fs::File::open(path).map_err(|e| io(path, e))?;
    let len = file.metadata().map_err(|e| io(path, e))?.len();
    let mut prefix = [0u8; 8];
    // A header that does not read is a truncated or foreign file.
    let broken = |why: String| {
        io(
            path,
            format!("{why}; the file is truncated or not safetensors: download it again"),
        )
    };
    file.read_exact(&mut prefix)
        .map_err(|e| broken(format!("no header length ({e})")))?;
    let header_len = Header::length(prefix, len).map_err(broken)?;
    let mut bytes = vec![0u8; header_len as usize];
    file.read_exact(&mut bytes).map_err(|e| io(path, e))?;
    let header = Header::parse(&bytes).map_err(broken)?;
    let mut out = Vec::new();
    for (name, entry) in &header.tensors {
        let bad = |why: String| io(path, format!("tensor `{name}`: {why}"));
        let dtype = match entry.get("dtype").and_then(Value::as_str) {
            Some("F32") => StoredDtype::F32,
            Some("BF16") => StoredDtype::Bf16,
            Some("F16") => StoredDtype::F16,
            Some(other) => {
                return Err(bad(format!(
                    "dtype {other} is not one hybridgen reads (F32, BF16, F16); convert the checkpoint \
                     to one of them (a quantized checkpoint cannot be trained from)"
                )));
            }
            None => return Err(bad("no dtype".into())),
        };
        let shape = entry
            .get("shape")
            .and_then(Value::as_array)
            .and_then(|dims| {
                dims.iter()
                    .map(|d| d.as_u64().map(|d| d as usize))
                    .collect::<Option<Vec<_>>>()
            })
            .ok_or_else(|| bad("no shape of whole numbers".into()))?;
        let offsets = header
            .range(entry, u64::MAX)
            .ok_or_else(|| bad("no data_offsets".into()))?;
        let numel = shape
            .iter()
            .try_fold(1u64, |n, &d| n.checked_mul(d as u64))
            .ok_or_else(|| bad(format!("shape {shape:?} is too large")))?;
        let want = numel.checked_mul(dtype.size() as u64);
        if Some(offsets.1 - offsets.0) != want || header.range(entry, len).is_none() {
            return Err(bad(format!(
                "its bytes {}..{} do not hold {shape:?} {} elements inside the file",
                offsets.0,
                offsets.1,
                dtype.name()
            )));
        }
        out.push((
            name.clone(),
            StoredTensor {
                file: path.to_path_buf(),
                dtype,
                shape,
                offset: header.data_start + offsets.0,
            },
        ));
    }
    Ok(out)
}

/// One tensor to write: its name, shape and stored dtype.
#[derive(Clone, Debug)]
pub struct Planned {
    pub name: String,
    pub shape: Vec<usize>,
    pub dtype: HfDtype,
}

impl Planned {
    pub fn bytes(&self) -> u64 {
        let size = match self.dtype {
            HfDtype::Bf16 => 2,
            HfDtype::F32 => 4,
        };
        self.shape.iter().product::<usize>() as u64 * size
    }
}

/// The files an export of `tensors` is split into: tensors in order, a new
/// shard whenever the next tensor would take one past `limit` bytes.
/// Returns each file's name and the tensors (indices) in it.
pub fn shard(tensors: &[Planned], limit: u64) -> Vec<(String, Vec<usize>)> {
    let mut groups: Vec<Vec<usize>> = Vec::new();
    let mut size = 0u64;
    for (i, t) in tensors.iter().enumerate() {
        if groups.is_empty() || (size > 0 && size + t.bytes() > limit) {
            groups.push(Vec::new());
            size = 0;
        }
        groups.last_mut().expect("a group was pushed").push(i);
        size += t.bytes();
    }
    let n = groups.len();
    groups
        .into_iter()
        .enumerate()
        .map(|(k, g)| {
            let name = if n == 1 {
                SINGLE.to_string()
            } else {
                format!("model-{:05}-of-{n:05}.safetensors", k + 1)
            };
            (name, g)
        })
        .collect()
}

/// Encodes f32 values as `dtype`'s little-endian bytes (bf16 rounds to
/// nearest even).
pub fn encode(values: &[f32], dtype: HfDtype) -> Vec<u8> {
    match dtype {
        HfDtype::F32 => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
        HfDtype::Bf16 => values
            .iter()
            .flat_map(|v| half::bf16::from_f32(*v).to_le_bytes())
            .collect(),
    }
}

/// Refuses an output path that is taken: only a missing path or an empty
/// directory becomes the folder.
pub fn check_output(out: &Path) -> Result<()> {
    check_new(out, "export")
}

/// Refuses `out` unless it is missing or an empty directory; `verb` says
/// what wanted it (`export`, `import`).
pub fn check_new(out: &Path, verb: &str) -> Result<()> {
    match std::fs::read_dir(out) {
        Ok(mut entries) => {
            if entries.next().is_some() {
                return Err(io(
                    out,
                    format!(
                        "exists and is not empty; {verb} to a new directory (nothing was written)"
                    ),
                ));
            }
            Ok(())
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(_) if out.exists() => Err(io(
            out,
            format!(
                "exists and is not a directory; {verb} to a new directory (nothing was written)"
            ),
        )),
        Err(e) => Err(io(out, e)),
    }
}

/// Writes the folder: `config.json`, the shards (each tensor's bytes from
/// `bytes_of`, called once per tensor in order) and, past one shard, the
/// index. Everything goes into `OUT.partial` first, fsynced, then renamed
/// to `out`.
pub fn write_folder(
    out: &Path,
    config: &Value,
    tensors: &[Planned],
    limit: u64,
    bytes_of: &mut dyn FnMut(usize) -> Result<Vec<u8>>,
) -> Result<Vec<String>> {
    check_output(out)?;
    let mut partial = out.as_os_str().to_os_string();
    partial.push(".partial");
    let partial = PathBuf::from(partial);
    if partial.exists() {
        std::fs::remove_dir_all(&partial).map_err(|e| io(&partial, e))?;
    }
    std::fs::create_dir_all(&partial).map_err(|e| io(&partial, e))?;
    let written = write_into(&partial, config, tensors, limit, bytes_of);
    if let Err(e) = written {
        let _ = std::fs::remove_dir_all(&partial);
        return Err(e);
    }
    if out.exists() {
        // An empty directory, checked above: the rename replaces it.
        std::fs::remove_dir(out).map_err(|e| io(out, e))?;
    }
    durable::sync_dir_quietly(&partial)?;
    std::fs::rename(&partial, out)
        .map_err(|e| io(out, format!("cannot rename {}: {e}", partial.display())))?;
    if let Some(parent) = out.parent().filter(|p| !p.as_os_str().is_empty()) {
        durable::sync_dir_quietly(parent)?;
    }
    written
}

/// Writes `bytes` as file `path` and fsyncs it.
fn write_synced(path: &Path, bytes: &[u8]) -> Result<()> {
    use std::io::Write;
    let mut file = std::fs::File::create(path).map_err(|e| io(path, e))?;
    file.write_all(bytes)
        .and_then(|()| file.sync_all())
        .map_err(|e| io(path, e))
}

fn write_into(
    dir: &Path,
    config: &Value,
    tensors: &[Planned],
    limit: u64,
    bytes_of: &mut dyn FnMut(usize) -> Result<Vec<u8>>,
) -> Result<Vec<String>> {
    let text = serde_json::to_string_pretty(config).map_err(|e| io(&dir.join(CONFIG), e))?;
    write_synced(&dir.join(CONFIG), format!("{text}\n").as_bytes())?;
    let shards = shard(tensors, limit);
    let mut weight_map = Map::new();
    let mut names = vec![CONFIG.to_string()];
    for (file, members) in &shards {
        let mut data = Vec::with_capacity(members.len());
        for &i in members {
            let bytes = bytes_of(i)?;
            if bytes.len() as u64 != tensors[i].bytes() {
                return Err(RuntimeError::InvalidArgument(format!(
                    "tensor `{}` came with {} bytes, not {}",
                    tensors[i].name,
                    bytes.len(),
                    tensors[i].bytes()
                )));
            }
            data.push(bytes);
            weight_map.insert(tensors[i].name.clone(), json!(file));
        }
        let views = members
            .iter()
            .zip(&data)
            .map(|(&i, bytes)| {
                let t = &tensors[i];
                let dtype = match t.dtype {
                    HfDtype::Bf16 => safetensors::Dtype::BF16,
                    HfDtype::F32 => safetensors::Dtype::F32,
                };
                safetensors::tensor::TensorView::new(dtype, t.shape.clone(), bytes)
                    .map(|v| (t.name.clone(), v))
                    .map_err(|e| io(&dir.join(file), format!("{}: {e}", t.name)))
            })
            .collect::<Result<Vec<_>>>()?;
        // transformers refuses safetensors files without `format: pt`.
        let metadata = std::collections::HashMap::from([("format".to_string(), "pt".to_string())]);
        // Streamed from the tensors' bytes: a 5 GB shard is not held a
        // second time as one serialized buffer.
        let path = dir.join(file);
        safetensors::serialize_to_file(views, Some(metadata), &path).map_err(|e| io(&path, e))?;
        std::fs::File::open(&path)
            .and_then(|f| f.sync_all())
            .map_err(|e| io(&path, e))?;
        names.push(file.clone());
    }
    if shards.len() > 1 {
        let total: u64 = tensors.iter().map(Planned::bytes).sum();
        let index = json!({"metadata": {"total_size": total}, "weight_map": weight_map});
        let text = serde_json::to_string_pretty(&index).map_err(|e| io(&dir.join(INDEX), e))?;
        write_synced(&dir.join(INDEX), format!("{text}\n").as_bytes())?;
        names.push(INDEX.to_string());
    }
    Ok(names)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn planned(n: usize) -> Planned {
        Planned {
            name: format!("t{n}"),
            shape: vec![n],
            dtype: HfDtype::F32,
        }
    }

    #[test]
    fn shards_split_before_the_tensor_that_would_pass_the_limit() {
        let tensors: Vec<Planned> = [10, 10, 5, 30, 1].into_iter().map(planned).collect();
        // bytes: 40, 40, 20, 120, 4
        let shards = shard(&tensors, 100);
        let groups: Vec<Vec<usize>> = shards.iter().map(|(_, g)| g.clone()).collect();
        assert_eq!(groups, vec![vec![0, 1, 2], vec![3], vec![4]]);
        assert_eq!(shards[0].0, "model-00001-of-00003.safetensors");
        assert_eq!(shard(&tensors, 1000)[0].0, SINGLE);
    }

    #[test]
    fn a_sharded_folder_is_written_with_an_index_and_reads_back() {
        let dir = std::env::temp_dir().join(format!("hybridgen-hf-files-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let out = dir.join("out");
        let tensors: Vec<Planned> = [3usize, 5, 2]
            .into_iter()
            .enumerate()
            .map(|(i, n)| Planned {
                name: format!("t{i}"),
                shape: vec![n],
                dtype: if i == 1 { HfDtype::Bf16 } else { HfDtype::F32 },
            })
            .collect();
        let values = |i: usize| -> Vec<f32> {
            (0..tensors[i].shape[0])
                .map(|k| (i * 10 + k) as f32 + 0.5)
                .collect()
        };
        let config = json!({"model_type": "nemotron_h"});
        let names = write_folder(&out, &config, &tensors, 12, &mut |i| {
            Ok(encode(&values(i), tensors[i].dtype))
        })
        .unwrap();
        assert_eq!(
            names,
            [
                CONFIG,
                "model-00001-of-00003.safetensors",
                "model-00002-of-00003.safetensors",
                "model-00003-of-00003.safetensors",
                INDEX
            ]
        );
        assert!(!dir.join("out.partial").exists());
        let folder = HfFolder::open(&out).unwrap();
        assert_eq!(folder.config, config);
        for (i, t) in tensors.iter().enumerate() {
            assert_eq!(folder.read_f32(&t.name).unwrap(), values(i), "{}", t.name);
        }
        assert_eq!(folder.tensors["t1"].dtype, StoredDtype::Bf16);
        // An index naming a file outside the folder is refused.
        let index = out.join(INDEX);
        let text = std::fs::read_to_string(&index).unwrap();
        std::fs::write(
            &index,
            text.replace("\"model-00001-of-00003", "\"../model-00001-of-00003"),
        )
        .unwrap();
        let err = HfFolder::open(&out).unwrap_err().to_string();
        assert!(err.contains("not a plain file name"), "{err}");
        // A taken folder is never written into.
        let err = write_folder(&out, &config, &tensors, 12, &mut |i| {
            Ok(encode(&values(i), tensors[i].dtype))
        })
        .unwrap_err()
        .to_string();
        assert!(err.contains("not empty"), "{err}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn pythons_infinity_becomes_a_string_outside_strings_only() {
        assert_eq!(
            quote_python_floats(
                r#"{"a": [0.0, Infinity], "b": "Infinity NaN", "c": -Infinity, "d": NaN}"#
            ),
            r#"{"a": [0.0, "Infinity"], "b": "Infinity NaN", "c": "-Infinity", "d": "NaN"}"#
        );
        assert_eq!(
            quote_python_floats(r#"{"e": "x\"Infinity"}"#),
            r#"{"e": "x\"Infinity"}"#
        );
    }

    #[test]
    fn bf16_encoding_rounds_to_nearest_even() {
        // 1 + 2^-8 lies halfway between two bf16 values: ties go to even (1.0).
        let bytes = encode(&[1.0 + 1.0 / 256.0, 1.0 + 3.0 / 256.0], HfDtype::Bf16);
        let back: Vec<f32> = bytes
            .chunks_exact(2)
            .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect();
        assert_eq!(back, vec![1.0, 1.0 + 4.0 / 256.0]);
    }
}
