//! CPU lanes: a worker thread per lane with a queue; events as a flag with a condition variable.
