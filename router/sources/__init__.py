"""Discovery sources: each one feeds a `ClusterView` and says when it has synced."""
