"""When a rank fails or hangs: fail-fast (one rank's failure ends the job) and the
hang tools (stacks on SIGUSR1, the collective and hang timeouts and their
watchdog)."""
