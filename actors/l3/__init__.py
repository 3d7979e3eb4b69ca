"""The L3 shared tier, the Ray side: `namespace_actor` (the named, detached namespace actor,
`get_or_create_namespace_actor`, and `NamespaceClient`, the one place that calls it),
`namespace_service` (the actor's body without Ray: page directory, persisted specs, Mooncake
masters), `rank_link` (`RankL3Link`: a rank's link to its namespace and its own storage
client) and `hosts` (the addresses the L3 binds and registers when ranks span hosts).
"""
