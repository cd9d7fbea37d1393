//! hybridgen facade (in progress)
