//! Layers with hand-written forward, input-gradient and weight-gradient backward (shared/spec/layers.md).
