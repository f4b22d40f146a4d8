"""Who talks to whom. The only part of nbdist that moves tensors over MPI."""
