"""What nanospec tells its user: the one warning, why a head is (not) rewritten, explain() and its cost
model, the pass's reports and Dynamo's limits."""
