"""SQL persistence shared by the services that own tables (queue: the ledger; trainer: jobs)."""
