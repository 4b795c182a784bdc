"""The compiled collectives: the in-place allreduce and the non-blocking one."""
