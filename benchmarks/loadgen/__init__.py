"""HTTP load generator on the OpenAI API: workload, client, statistics, reports."""
