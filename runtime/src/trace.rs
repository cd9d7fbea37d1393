//! A Chrome-trace (Perfetto) recorder: one track per rank and lane.
