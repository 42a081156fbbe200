"""Offline tools: nothing here trains. The event simulator of schedules (`simulate`) and the plans of the
schedules it is compared with (`schedule_plans`), the memory plan (`memory_plan`) and its fake-tensor meter
(`fake_memory`), the embedded text corpus (`corpus`) and a runtime demo without Lightning (`demo`)."""
