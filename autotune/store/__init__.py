"""The strategy store: tables, the Storage class, engine / URL set-up, records, strategy resolution
and the hardware key."""
