//! The header of a safetensors file, as both readers of them take it:
//! checkpoints' rank files (`checkpoint`) and Hugging Face folders (`hf`).
//! A file is an 8-byte little-endian header length, the header (a JSON map
//! from tensor name to dtype, shape and `data_offsets`, plus an optional
//! `__metadata__` map of strings), then the tensors' bytes. The header
//! comes from files hybridgen did not write, so its length is capped and
//! every range is checked against the file before anything is read.

use serde_json::{Map, Value};

/// The largest header read (a published 30B model's shard lists a few
/// thousand tensors in well under a megabyte).
pub const MAX_HEADER_BYTES: u64 = 256 << 20;

/// A parsed header: the tensors' entries (without `__metadata__`), the
/// metadata, and where the tensors' bytes start.
pub struct Header {
    pub tensors: Map<String, Value>,
    pub metadata: Map<String, Value>,
    pub data_start: u64,
}

impl Header {
    /// The header length the first 8 bytes of a `file_len`-byte file
    /// give, checked against the cap and the file; `Err` says why not.
    pub fn length(prefix: [u8; 8], file_len: u64) -> Result<u64, String> {
        let len = u64::from_le_bytes(prefix);
        if len > MAX_HEADER_BYTES || len.checked_add(8).is_none_or(|end| end > file_len) {
            return Err(format!(
                "its header length {len} does not fit the {file_len}-byte file"
            ));
        }
        Ok(len)
    }

    /// Parses the header's JSON (`bytes`: the `length` bytes after the
    /// prefix).
    pub fn parse(bytes: &[u8]) -> Result<Header, String> {
        let mut tensors: Map<String, Value> = serde_json::from_slice(bytes)
            .map_err(|e| format!("its safetensors header is not valid JSON: {e}"))?;
        let metadata = match tensors.remove("__metadata__") {
            Some(Value::Object(m)) => m,
            _ => Map::new(),
        };
        Ok(Header {
            tensors,
            metadata,
            data_start: 8 + bytes.len() as u64,
        })
    }

    /// A tensor entry's `[start, end)` byte range relative to the data,
    /// when it is well formed and lies inside a `file_len`-byte file.
    pub fn range(&self, entry: &Value, file_len: u64) -> Option<(u64, u64)> {
        let offsets = entry.get("data_offsets")?.as_array()?;
        let (start, end) = (offsets.first()?.as_u64()?, offsets.get(1)?.as_u64()?);
        (start <= end
            && self
                .data_start
                .checked_add(end)
                .is_some_and(|last| last <= file_len))
        .then_some((start, end))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lengths_past_the_cap_or_the_file_are_refused() {
        assert_eq!(Header::length(16u64.to_le_bytes(), 24), Ok(16));
        assert!(Header::length(17u64.to_le_bytes(), 24).is_err());
        assert!(Header::length(u64::MAX.to_le_bytes(), u64::MAX).is_err());
        assert!(Header::length((MAX_HEADER_BYTES + 1).to_le_bytes(), u64::MAX).is_err());
    }

    #[test]
    fn a_header_splits_into_tensors_metadata_and_checked_ranges() {
        let json = br#"{"__metadata__":{"format":"pt"},"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"data_offsets":[8,4]}}"#;
        let h = Header::parse(json).unwrap();
        assert_eq!(h.data_start, 8 + json.len() as u64);
        assert_eq!(h.metadata["format"], "pt");
        assert_eq!(h.tensors.len(), 2);
        let end = h.data_start + 8;
        assert_eq!(h.range(&h.tensors["a"], end), Some((0, 8)));
        assert_eq!(h.range(&h.tensors["a"], end - 1), None);
        assert_eq!(h.range(&h.tensors["b"], u64::MAX), None);
        assert!(Header::parse(b"{not json").is_err());
    }
}
