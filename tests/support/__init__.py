"""What tests share: fake and fault-injecting runners, tiny and real models, a real
redis-server, engine/scheduler fixtures, polling waits. One place, imported by every suite."""
