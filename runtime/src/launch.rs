//! Finding ranks the way torchrun and srun set them, and the TCP rendezvous that hands rank 0's bytes to the others.
