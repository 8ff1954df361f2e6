"""Network emulation: emulated hosts (namespaces + tc tbf) and bandwidth schedules."""
