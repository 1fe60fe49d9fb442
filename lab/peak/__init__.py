"""The peak finder: the highest VALID Server QPS of a system through the product path, each point's tail anatomy
(where the slowest queries' time went), and the one-query probe."""
