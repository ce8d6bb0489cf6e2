"""Multi-agent episode programs (workflows), their API and the worker that runs them."""
