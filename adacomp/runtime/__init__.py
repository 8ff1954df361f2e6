"""Distributed runtime: the process's backend context, start-of-training sync, checkpoint sets, the watchdog, the local launcher and Horovod's module-level API."""
