//! Training data: a synthetic stream with a known entropy floor, or a file read as bytes.
