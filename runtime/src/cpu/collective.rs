//! CPU collectives: ranks as threads of one process, exchanging through shared memory with sums in rank order.
