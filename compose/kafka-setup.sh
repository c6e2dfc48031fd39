#!/bin/sh
# Principals and ACLs of the compose Kafka, made once it answers. Runs as User:operator (the client
# certificate CN=operator, the only super user besides the broker) over the broker's mutual-TLS
# listener, kafka:19094, which is not published to the host.
#   - a SCRAM-SHA-512 user per role: admin (topic admin), producer, projector, analyst;
#   - the ACLs docs/security.md lists for each role, as written there (tests/test_compose.py
#     checks that they match).
set -eu
BIN=/opt/kafka/bin
BROKER=kafka:19094
OPERATOR=/certs/operator.properties

scram_user() {  # scram_user NAME PASSWORD
  "$BIN/kafka-configs.sh" --bootstrap-server "$BROKER" --command-config "$OPERATOR" --alter \
    --entity-type users --entity-name "$1" --add-config "SCRAM-SHA-512=[password=$2]"
}
scram_user admin "$ADMIN_PASSWORD"
scram_user producer "$PRODUCER_PASSWORD"
scram_user projector "$PROJECTOR_PASSWORD"
scram_user analyst "$ANALYST_PASSWORD"

acls() {
  "$BIN/kafka-acls.sh" --bootstrap-server "$BROKER" --command-config "$OPERATOR" "$@"
}
# Topic admin
acls --add --allow-principal User:admin --operation Create --operation Describe \
  --resource-pattern-type prefixed --topic stepstream.
# Producer
acls --add --allow-principal User:producer --operation Write --operation Describe \
  --topic stepstream.step-events --topic stepstream.tool-effects
# Projector
acls --add --allow-principal User:projector --operation Read --operation Describe \
  --topic stepstream.step-events --topic stepstream.tool-effects
acls --add --allow-principal User:projector --operation Write --operation Describe --topic stepstream.dlq
acls --add --allow-principal User:projector --operation Read --group stepstream.projector
# Read-only
acls --add --allow-principal User:analyst --operation Read --operation Describe \
  --topic stepstream.step-events --topic stepstream.tool-effects --topic stepstream.dlq
acls --add --allow-principal User:analyst --operation Read --resource-pattern-type prefixed --group analytics.
