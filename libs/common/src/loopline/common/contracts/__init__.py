"""What the parts agree on, each defined once: NATS subjects and streams, wire schemas (generate,
jobs, Tinker), the job hash, the job directory and adapter layouts, training params and archives,
what a job's environment may hold, and the Tinker SDK's protobuf bodies."""
