"""Prefill/decode disaggregation, the Ray side: `driver` (`PDDriver`: each request prefilled on
a prefill instance and decoded on a decode instance that received its prompt's KV),
`deployment` (`PDDeployment`: P prefill and D decode instances behind one Serve deployment of
the serve graph) and `rank_port` (`RankHandoffPort`: a rank's hand-off calls over its engine
and one transport endpoint). The Ray-free hand-off is kvtier.engine.handoff; docs/prefill-decode.md
tells how to run it.
"""
