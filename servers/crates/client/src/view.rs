//! One weight map of a job as the client uses it: the servers with their placement (and prefix
//! routes), the lost servers, and the capability context every request carries. A client swaps
//! its view whole when it adopts a newer epoch, so one call always places and addresses with one
//! consistent map.

use std::collections::{BTreeMap, HashMap};

use bytes::Bytes;
use pocketflow_protocol::context::Context;
use serde_json::{Map, Value};

use crate::error::ClientError;
use crate::placement::{PlacedServer, Placement, Routes, SERVERS_MAX};

/// Significant digits a weight keeps (as `pocketflow.handle.WEIGHT_SIGNIFICANT_DIGITS`): both
/// languages round the same way, so both place a key on the same server.
const WEIGHT_SIGNIFICANT_DIGITS: usize = 6;
/// Most lost servers a map remembers (as `pocketflow.handle.LOST_SERVERS_MAX`).
const LOST_SERVERS_MAX: usize = 16;
/// Most earlier placements a map remembers (as `pocketflow.handle.EARLIER_MAPS_MAX`).
const EARLIER_MAPS_MAX: usize = 16;
/// Most rows (servers, pool members, routes) they hold together (as
/// `pocketflow.handle.EARLIER_ROWS_MAX`).
const EARLIER_ROWS_MAX: usize = 1024;
/// The fields of a weight map a view takes from a `stale_epoch` answer or a `set_epoch`; the
/// optional ones (all but `epoch` and `servers`) are dropped when the new map has none.
const WEIGHT_MAP_FIELDS: [&str; 8] = [
    "epoch",
    "servers",
    "lost",
    "pools",
    "routes",
    "suspects",
    "held_weights",
    "earlier",
];

/// One storage server of a weight map.
#[derive(Debug, Clone, PartialEq)]
pub struct Server {
    /// The server's node id (its placement seed comes from it).
    pub node_id: String,
    /// `host:port`.
    pub address: String,
    /// Its share of the job's new data; 0 takes none, but its records stay readable.
    pub weight: f64,
    /// Whether it is long-running (takes PERSIST objects).
    pub persist: bool,
}

/// A server declared dead while it was in the job's map.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LostServer {
    /// Its node id.
    pub node_id: String,
    /// Its address.
    pub address: String,
}

/// Where an earlier map of the job placed keys (one entry of the map's `"earlier"`).
#[derive(Debug)]
struct EarlierPlacement {
    /// Placement over the earlier map's servers, as placement saw them then.
    placement: Placement,
    /// For each of those servers, its index in this map's `servers` (`None`: no longer in it).
    in_view: Vec<Option<usize>>,
}

/// One consistent weight map of a job, with everything derived from it.
#[derive(Debug)]
pub struct View {
    /// The job handle as JSON fields (`job`, `name`, `token`, `block_size`, `tls_ca`, ...), with
    /// this view's `epoch`, `servers`, `lost`, `pools` and `routes`: what [`View::handle_json`]
    /// gives back.
    handle: Map<String, Value>,
    /// The capability context of this map.
    pub ctx: Context,
    /// Weight-map epoch.
    pub epoch: u64,
    /// Servers, in the map's order (placement results index into it).
    pub servers: Vec<Server>,
    /// Servers the job lost to failures, oldest first.
    pub lost: Vec<LostServer>,
    /// Bytes per data block of new large objects.
    pub block_size: u32,
    /// Placement over `servers`, with the map's prefix routes (suspects take no new data).
    pub placement: Placement,
    /// Node ids of the servers the control plane suspects (hung: running, not answering).
    pub suspects: Vec<String>,
    /// The placement of the map with each suspect's weight given back (from the map's
    /// `held_weights`, or the suspect's own row when it kept its weight), where records written
    /// before the suspicion are; `None` when the map has no suspects.
    held_placement: Option<Placement>,
    /// Suspects whose weight before the suspicion the map does not say: they may hold any key.
    suspects_unweighed: Vec<String>,
    /// Where the job's earlier maps placed keys; `None` when the map does not say (then any
    /// server may hold a key written before).
    earlier: Option<Vec<EarlierPlacement>>,
    /// The DoExchange descriptor command (`{"ctx": ...}`).
    pub exchange_command: Bytes,
}

fn malformed(what: &str, why: impl std::fmt::Display) -> ClientError {
    ClientError::InvalidArgument(format!("malformed {what}: {why}"))
}

fn rounded_weight(weight: f64) -> f64 {
    let text = format!("{:.*e}", WEIGHT_SIGNIFICANT_DIGITS - 1, weight);
    text.parse().unwrap_or(weight)
}

fn text_of(value: &Value, what: &str) -> Result<String, ClientError> {
    match value {
        Value::String(s) => Ok(s.clone()),
        Value::Number(n) => Ok(n.to_string()),
        other => Err(malformed(what, format!("expected text, got {other}"))),
    }
}

fn server_of(row: &Value) -> Result<Server, ClientError> {
    let (node_id, address, weight, persist) = match row {
        Value::Array(fields) if fields.len() == 5 => {
            (&fields[0], &fields[1], &fields[3], Some(&fields[4]))
        }
        Value::Object(fields) => (
            fields.get("node_id").unwrap_or(&Value::Null),
            fields.get("address").unwrap_or(&Value::Null),
            fields.get("weight").unwrap_or(&Value::Null),
            fields.get("persist"),
        ),
        other => return Err(malformed("weight-map row", format!("{other:.200}"))),
    };
    let weight = weight
        .as_f64()
        .filter(|w| w.is_finite() && *w >= 0.0)
        .ok_or_else(|| malformed("weight-map row", "weight must be a finite number >= 0"))?;
    let persist = match persist {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(Value::Number(n)) => n.as_f64().is_some_and(|v| v != 0.0),
        Some(other) => return Err(malformed("weight-map row", format!("persist {other}"))),
    };
    let node_id = text_of(node_id, "node id")?;
    let address = text_of(address, "server address")?;
    if node_id.is_empty() || !address.contains(':') {
        return Err(malformed("weight-map row", "empty node id or no port"));
    }
    Ok(Server {
        node_id,
        address,
        weight: rounded_weight(weight),
        persist,
    })
}

fn lost_of(row: &Value) -> Result<LostServer, ClientError> {
    match row {
        Value::Array(fields) if fields.len() == 2 => Ok(LostServer {
            node_id: text_of(&fields[0], "lost node id")?,
            address: text_of(&fields[1], "lost address")?,
        }),
        other => Err(malformed("lost-server row", format!("{other:.200}"))),
    }
}

/// The node ids of one pool of a weight map's `"pools"`.
fn members_of(name: &str, members: &Value) -> Result<Vec<String>, ClientError> {
    let rows = members
        .as_array()
        .ok_or_else(|| malformed("weight map", format!("pool {name:.64} is not a list")))?;
    if rows.len() > SERVERS_MAX {
        return Err(malformed(
            "weight map",
            format!("pool {name:.64} has more than {SERVERS_MAX} members"),
        ));
    }
    rows.iter()
        .map(|id| {
            text_of(id, "pool member")
                .map_err(|_| malformed("weight map", format!("pool {name:.64} member {id:.200}")))
        })
        .collect()
}

/// The prefix routes of a weight map (`"pools"` and `"routes"`, both optional).
fn routes_of(map: &Map<String, Value>) -> Result<Routes, ClientError> {
    let pools = match map.get("pools") {
        None | Some(Value::Null) => BTreeMap::new(),
        Some(Value::Object(pools)) => pools
            .iter()
            .map(|(name, members)| Ok((name.clone(), members_of(name, members)?)))
            .collect::<Result<_, ClientError>>()?,
        Some(other) => return Err(malformed("weight map", format!("pools {other:.200}"))),
    };
    let routes = match map.get("routes") {
        None | Some(Value::Null) => BTreeMap::new(),
        Some(Value::Object(routes)) => routes
            .iter()
            .map(|(prefix, pool)| match pool {
                Value::String(pool) => Ok((prefix.clone(), pool.clone())),
                other => Err(malformed("weight map", format!("route to {other:.200}"))),
            })
            .collect::<Result<_, ClientError>>()?,
        Some(other) => return Err(malformed("weight map", format!("routes {other:.200}"))),
    };
    Routes::new(pools, routes)
}

/// The node ids of a weight map's `"suspects"` (optional).
fn suspects_of(map: &Map<String, Value>) -> Result<Vec<String>, ClientError> {
    match map.get("suspects") {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::Array(ids)) if ids.len() <= SERVERS_MAX => ids
            .iter()
            .map(|id| text_of(id, "suspect node id"))
            .collect(),
        Some(other) => Err(malformed("weight map", format!("suspects {other:.200}"))),
    }
}

/// A weight map's `"held_weights"` (optional): `{node_id: [weight, persist]}`, the weight each
/// suspect had before it was suspected.
fn held_weights_of(map: &Map<String, Value>) -> Result<BTreeMap<String, (f64, bool)>, ClientError> {
    let rows = match map.get("held_weights") {
        None | Some(Value::Null) => return Ok(BTreeMap::new()),
        Some(Value::Object(rows)) if rows.len() <= SERVERS_MAX => rows,
        Some(other) => {
            return Err(malformed(
                "weight map",
                format!("held_weights {other:.200}"),
            ))
        }
    };
    rows.iter()
        .map(|(node_id, row)| {
            let held = match row.as_array().map(Vec::as_slice) {
                Some([weight, persist]) => {
                    weight.as_f64().filter(|w| w.is_finite() && *w >= 0.0).zip(
                        persist
                            .as_bool()
                            .or_else(|| persist.as_u64().map(|p| p != 0)),
                    )
                }
                _ => None,
            };
            held.map(|(weight, persist)| (node_id.clone(), (rounded_weight(weight), persist)))
                .ok_or_else(|| malformed("weight map", format!("held weight {row:.200}")))
        })
        .collect()
}

/// A weight map's `"earlier"` (optional): `[{"servers": [[node_id, weight, persist], ...],
/// "pools"?, "routes"?}, ...]`, the distinct placements of the job's earlier maps, each indexed
/// against `servers` (this map's).
fn earlier_of(
    map: &Map<String, Value>,
    servers: &[Server],
) -> Result<Option<Vec<EarlierPlacement>>, ClientError> {
    let entries = match map.get("earlier") {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::Array(entries)) if entries.len() <= EARLIER_MAPS_MAX => entries,
        Some(other) => return Err(malformed("weight map", format!("earlier {other:.200}"))),
    };
    let index_of: HashMap<&str, usize> = servers
        .iter()
        .enumerate()
        .map(|(i, s)| (s.node_id.as_str(), i))
        .collect();
    let mut rows_total = 0usize;
    let mut earlier = Vec::with_capacity(entries.len());
    for entry in entries {
        let bad = || malformed("weight map", format!("earlier map {entry:.200}"));
        let fields = entry.as_object().ok_or_else(bad)?;
        let rows = fields
            .get("servers")
            .and_then(Value::as_array)
            .ok_or_else(bad)?;
        let routes = routes_of(fields)?;
        rows_total += rows.len() + routes.rows();
        if rows_total > EARLIER_ROWS_MAX {
            return Err(malformed(
                "weight map",
                format!("earlier maps hold more than {EARLIER_ROWS_MAX} rows"),
            ));
        }
        let placed = rows
            .iter()
            .map(|row| match row.as_array().map(Vec::as_slice) {
                Some([Value::String(node_id), weight, persist]) => {
                    let weight = weight.as_f64().filter(|w| w.is_finite() && *w >= 0.0);
                    let persist = persist
                        .as_bool()
                        .or_else(|| persist.as_u64().map(|p| p != 0));
                    match (weight, persist) {
                        (Some(weight), Some(persist)) => Ok(PlacedServer {
                            node_id: node_id.clone(),
                            weight: rounded_weight(weight),
                            persist,
                        }),
                        _ => Err(bad()),
                    }
                }
                _ => Err(bad()),
            })
            .collect::<Result<Vec<_>, _>>()?;
        let in_view = placed
            .iter()
            .map(|p| index_of.get(p.node_id.as_str()).copied())
            .collect();
        earlier.push(EarlierPlacement {
            placement: Placement::with_routes(&placed, routes),
            in_view,
        });
    }
    Ok(Some(earlier))
}

/// `(epoch, servers, lost)` of a weight map `{"epoch", "servers", "lost"?, ...}`.
fn map_parts(map: &Map<String, Value>) -> Result<(u64, Vec<Server>, Vec<LostServer>), ClientError> {
    let epoch = map
        .get("epoch")
        .and_then(Value::as_u64)
        .ok_or_else(|| malformed("weight map", "no epoch"))?;
    let rows = map
        .get("servers")
        .and_then(Value::as_array)
        .ok_or_else(|| malformed("weight map", "no servers"))?;
    if rows.len() > SERVERS_MAX {
        return Err(malformed(
            "weight map",
            format!("more than {SERVERS_MAX} servers"),
        ));
    }
    let servers = rows.iter().map(server_of).collect::<Result<Vec<_>, _>>()?;
    let lost = match map.get("lost") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(rows)) => rows
            .iter()
            .take(LOST_SERVERS_MAX)
            .map(lost_of)
            .collect::<Result<Vec<_>, _>>()?,
        Some(other) => return Err(malformed("weight map", format!("lost {other:.200}"))),
    };
    Ok((epoch, servers, lost))
}

impl View {
    /// The view of a job handle in the JSON form of `JobHandle.to_json`.
    pub fn from_handle_json(text: &str) -> Result<View, ClientError> {
        let handle: Map<String, Value> =
            serde_json::from_str(text).map_err(|e| malformed("job handle", e))?;
        View::from_handle(handle)
    }

    fn from_handle(handle: Map<String, Value>) -> Result<View, ClientError> {
        let (epoch, servers, lost) = map_parts(&handle)?;
        let routes = routes_of(&handle)?;
        let job = handle
            .get("job")
            .and_then(Value::as_str)
            .ok_or_else(|| malformed("job handle", "no job id"))?
            .to_string();
        let token = handle
            .get("token")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string();
        let block_size = handle
            .get("block_size")
            .and_then(Value::as_u64)
            .and_then(|b| u32::try_from(b).ok())
            .filter(|b| *b > 0)
            .ok_or_else(|| malformed("job handle", "block_size"))?;
        let ctx = Context { job, epoch, token };
        let exchange_command = Bytes::from(
            serde_json::to_vec(&serde_json::json!({ "ctx": &ctx })).expect("a context serializes"),
        );
        let suspects = suspects_of(&handle)?;
        let held_weights = held_weights_of(&handle)?;
        let earlier = earlier_of(&handle, &servers)?;
        let placed: Vec<PlacedServer> = servers
            .iter()
            .map(|s| {
                let suspect = suspects.contains(&s.node_id);
                PlacedServer {
                    node_id: s.node_id.clone(),
                    weight: if suspect { 0.0 } else { s.weight },
                    persist: s.persist && !suspect,
                }
            })
            .collect();
        let mut suspects_unweighed = Vec::new();
        let held_placement = (!suspects.is_empty()).then(|| {
            let held: Vec<PlacedServer> = servers
                .iter()
                .map(|s| {
                    let (weight, persist) = match held_weights.get(&s.node_id) {
                        Some(&held) => held,
                        None => {
                            if suspects.contains(&s.node_id) && s.weight == 0.0 {
                                suspects_unweighed.push(s.node_id.clone());
                            }
                            (s.weight, s.persist)
                        }
                    };
                    PlacedServer {
                        node_id: s.node_id.clone(),
                        weight,
                        persist,
                    }
                })
                .collect();
            Placement::with_routes(&held, routes.clone())
        });
        Ok(View {
            handle,
            ctx,
            epoch,
            placement: Placement::with_routes(&placed, routes),
            suspects,
            held_placement,
            suspects_unweighed,
            earlier,
            servers,
            lost,
            block_size,
            exchange_command,
        })
    }

    /// This view with the weight map of a `stale_epoch` answer or a `set_epoch` (its epoch,
    /// servers, lost list, pools and routes; job, token and block size stay).
    pub fn with_weight_map(&self, weight_map: &Map<String, Value>) -> Result<View, ClientError> {
        let mut handle = self.handle.clone();
        for field in ["epoch", "servers"] {
            if !weight_map.contains_key(field) {
                return Err(malformed("weight map", format!("no {field}")));
            }
        }
        for field in WEIGHT_MAP_FIELDS {
            match weight_map.get(field) {
                Some(value) if !value.is_null() => {
                    handle.insert(field.to_string(), value.clone());
                }
                _ => {
                    handle.remove(field);
                }
            }
        }
        View::from_handle(handle)
    }

    /// This view's weight map (`{"epoch", "servers", "lost"?, "pools"?, "routes"?}`), as a
    /// handle carries it.
    pub fn weight_map(&self) -> Map<String, Value> {
        let mut map = Map::new();
        for field in WEIGHT_MAP_FIELDS {
            if let Some(value) = self.handle.get(field) {
                map.insert(field.to_string(), value.clone());
            }
        }
        map
    }

    /// The handle of this view as JSON (`JobHandle.from_json` reads it).
    pub fn handle_json(&self) -> String {
        serde_json::to_string(&self.handle).expect("a JSON map serializes")
    }

    /// The server for block `block` of `key` (PERSIST placement with `persist`); `None` when no
    /// server of the map can take it.
    pub fn server_for(&self, key: &[u8], block: u32, persist: bool) -> Option<&Server> {
        self.placement
            .server_for(key, block, persist)
            .map(|i| &self.servers[i])
    }

    /// Every server of the map in the order fallback reads probe them for `(key, block)`.
    pub fn ranked(&self, key: &[u8], block: u32) -> impl Iterator<Item = &Server> {
        self.placement
            .ranked(key, block)
            .into_iter()
            .map(|i| &self.servers[i])
    }

    /// The servers of this map (indexes into `servers`) that an earlier map of the job placed
    /// block 0 of `key` on, ephemeral or PERSIST, each once; `None` when the map does not say
    /// where its earlier maps placed keys. Empty for a job's first map.
    pub fn earlier_homes(&self, key: &[u8]) -> Option<Vec<usize>> {
        if self.epoch <= 1 {
            return Some(Vec::new());
        }
        let earlier = self.earlier.as_ref()?;
        let mut homes: Vec<usize> = Vec::new();
        for map in earlier {
            for persist in [false, true] {
                let home = map
                    .placement
                    .server_for(key, 0, persist)
                    .and_then(|i| map.in_view[i]);
                if let Some(home) = home.filter(|h| !homes.contains(h)) {
                    homes.push(home);
                }
            }
        }
        Some(homes)
    }

    /// Whether the control plane suspects the server `node_id` (it may hang: never wait on it).
    pub fn is_suspect(&self, node_id: &str) -> bool {
        self.suspects.iter().any(|s| s == node_id)
    }

    /// Whether the suspect `node_id` may hold block 0 of `key`: the map with the suspects'
    /// held weights given back places it there (ephemeral or PERSIST), or the map does not say
    /// what the suspect weighed.
    pub fn suspect_may_hold(&self, key: &[u8], node_id: &str) -> bool {
        if self.suspects_unweighed.iter().any(|s| s == node_id) {
            return true;
        }
        let Some(held) = &self.held_placement else {
            return false;
        };
        [false, true].into_iter().any(|persist| {
            held.server_for(key, 0, persist)
                .is_some_and(|i| self.servers[i].node_id == node_id)
        })
    }

    /// The error of a read that found `what` on no server it could ask, when a suspect that
    /// may hold it was not asked; `None` when no suspect may hold it.
    pub fn suspect_error(&self, key: &[u8], what: &str) -> Option<(ClientError, String)> {
        let suspect = self
            .servers
            .iter()
            .find(|s| self.is_suspect(&s.node_id) && self.suspect_may_hold(key, &s.node_id))?;
        Some((
            ClientError::Server {
                code: tonic::Code::Unavailable as i32,
                message: format!(
                    "suspect_server: {what} may be on {}, which does not answer (a suspect of \
                     epoch {})",
                    suspect.node_id, self.epoch
                ),
            },
            suspect.address.clone(),
        ))
    }

    /// The error for `what` being on no live server of a job that lost servers; `None` when the
    /// job lost none (then it is simply not found).
    pub fn lost_error(&self, what: &str) -> Option<(ClientError, String)> {
        let last = self.lost.last()?;
        let names: Vec<&str> = self.lost.iter().map(|s| s.node_id.as_str()).collect();
        Some((
            ClientError::Unavailable(format!(
                "{what} is on no live server of the job; it may have been on a lost server ({})",
                names.join(", ")
            )),
            last.address.clone(),
        ))
    }
}

/// The weight map a `stale_epoch` status carries after its kind, if it parses as one.
pub fn stale_weight_map(message: &str) -> Option<Map<String, Value>> {
    let text = message.strip_prefix("stale_epoch: ")?;
    let mut stream = serde_json::Deserializer::from_str(text.trim_start()).into_iter::<Value>();
    match stream.next()? {
        Ok(Value::Object(map)) => Some(map),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const HANDLE: &str = r#"{"job":"j1","name":"n","epoch":1,"token":"t","block_size":1048576,
        "servers":[["dram-0","127.0.0.1:5000","dram",1,1],["dram-1","127.0.0.1:5001","dram",0.3333333333,0]]}"#;

    #[test]
    fn a_handle_parses_with_weights_rounded_as_python_does() {
        let view = View::from_handle_json(HANDLE).unwrap();
        assert_eq!(view.epoch, 1);
        assert_eq!(view.servers.len(), 2);
        assert_eq!(view.servers[1].weight, 0.333333);
        assert!(view.servers[0].persist && !view.servers[1].persist);
        assert_eq!(view.block_size, 1 << 20);
        assert!(view.lost.is_empty());
        assert!(view.lost_error("x").is_none());
        let command: Value = serde_json::from_slice(&view.exchange_command).unwrap();
        assert_eq!(command["ctx"]["job"], "j1");
        assert_eq!(command["ctx"]["epoch"], 1);
    }

    #[test]
    fn a_stale_answer_gives_a_new_map_that_keeps_the_job_and_token() {
        let view = View::from_handle_json(HANDLE).unwrap();
        let message = r#"stale_epoch: {"epoch":3,"servers":[["dram-1","127.0.0.1:5001","dram",1,0]],"lost":[["dram-0","127.0.0.1:5000"]]}"#;
        let map = stale_weight_map(message).unwrap();
        let newer = view.with_weight_map(&map).unwrap();
        assert_eq!(newer.epoch, 3);
        assert_eq!(newer.ctx.token, "t");
        assert_eq!(newer.servers.len(), 1);
        assert_eq!(newer.lost[0].node_id, "dram-0");
        let (error, server) = newer.lost_error("b/k").unwrap();
        assert!(error.to_string().contains("dram-0"));
        assert_eq!(server, "127.0.0.1:5000");
        let back: Value = serde_json::from_str(&newer.handle_json()).unwrap();
        assert_eq!(back["epoch"], 3);
        assert_eq!(back["name"], "n");
    }

    #[test]
    fn a_view_gives_back_its_weight_map() {
        let view = View::from_handle_json(HANDLE).unwrap();
        let map = view.weight_map();
        assert_eq!(map["epoch"], 1);
        assert_eq!(map["servers"].as_array().unwrap().len(), 2);
        assert!(!map.contains_key("token"));
        let again = view.with_weight_map(&map).unwrap();
        assert_eq!(again.servers, view.servers);
    }

    const ROUTED: &str = r#"{"job":"j1","name":"n","epoch":2,"token":"t","block_size":1048576,
        "servers":[["dram-0","127.0.0.1:5000","dram",1,1],["nvme-0","127.0.0.1:5001","nvme",0,0]],
        "pools":{"nvme":["nvme-0","nvme-9"],"dram":["dram-0"]},
        "routes":{"shuffle":"nvme","shuffle/hot":"dram"}}"#;

    #[test]
    fn a_handle_with_routes_places_routed_keys_on_their_pool() {
        let view = View::from_handle_json(ROUTED).unwrap();
        for n in 0..50 {
            let key = format!("shuffle/{n}");
            assert_eq!(
                view.server_for(key.as_bytes(), 1, false).unwrap().node_id,
                "nvme-0"
            );
            assert_eq!(
                view.server_for(key.as_bytes(), 1, true).unwrap().node_id,
                "dram-0"
            );
            let hot = format!("shuffle/hot/{n}");
            assert_eq!(
                view.server_for(hot.as_bytes(), 0, false).unwrap().node_id,
                "dram-0"
            );
            let other = format!("other/{n}");
            assert_eq!(
                view.server_for(other.as_bytes(), 0, false).unwrap().node_id,
                "dram-0"
            );
        }
    }

    #[test]
    fn routes_round_trip_through_the_handle_and_the_weight_map() {
        let view = View::from_handle_json(ROUTED).unwrap();
        let map = view.weight_map();
        assert_eq!(map["routes"]["shuffle"], "nvme");
        assert_eq!(map["pools"]["nvme"][1], "nvme-9");
        let back: Value = serde_json::from_str(&view.handle_json()).unwrap();
        assert_eq!(back["routes"], map["routes"]);
        assert_eq!(back["pools"], map["pools"]);
        let again = view.with_weight_map(&map).unwrap();
        assert_eq!(again.weight_map(), map);
        assert_eq!(
            again.server_for(b"shuffle/x", 0, false).unwrap().node_id,
            "nvme-0"
        );
        // A newer map without routes drops them.
        let mut plain = map.clone();
        plain.remove("pools");
        plain.insert("routes".to_string(), Value::Null);
        let newer = view.with_weight_map(&plain).unwrap();
        assert!(!newer.weight_map().contains_key("pools"));
        assert!(!newer.weight_map().contains_key("routes"));
        let back: Value = serde_json::from_str(&newer.handle_json()).unwrap();
        assert!(back.get("routes").is_none() && back.get("pools").is_none());
        assert_eq!(
            newer.server_for(b"shuffle/x", 0, false).unwrap().node_id,
            "dram-0"
        );
        // ... and one with routes adds them.
        let routed = newer.with_weight_map(&map).unwrap();
        assert_eq!(routed.weight_map(), map);
    }

    #[test]
    fn malformed_routes_are_refused() {
        let view = View::from_handle_json(HANDLE).unwrap();
        for (pools, routes) in [
            (r#"{"dram":["dram-0"]}"#, r#"{"a":"nvme"}"#),
            (r#"{"dram":["dram-0"]}"#, r#"{"a/":"dram"}"#),
            (r#"{"dram":["dram-0"]}"#, r#"{"a":1}"#),
            (r#"{"dram":"dram-0"}"#, r#"{"a":"dram"}"#),
            (r#"{"dram":[["dram-0"]]}"#, r#"{}"#),
            (r#"{"Dram":["dram-0"]}"#, r#"{}"#),
            (r#"["dram"]"#, r#"{}"#),
            (r#"{}"#, r#"["a"]"#),
        ] {
            let mut map = view.weight_map();
            map.insert("pools".into(), serde_json::from_str(pools).unwrap());
            map.insert("routes".into(), serde_json::from_str(routes).unwrap());
            let error = view.with_weight_map(&map).unwrap_err();
            assert!(
                error.to_string().contains("malformed weight map"),
                "{pools} {routes}: {error}"
            );
        }
    }

    #[test]
    fn an_earlier_placement_names_the_servers_that_held_a_key_before() {
        let first = View::from_handle_json(HANDLE).unwrap();
        let mut map = first.weight_map();
        map.insert("epoch".into(), 2.into());
        // Grown: dram-1 takes an equal share now; before, dram-0 held every key.
        map.insert(
            "servers".into(),
            serde_json::json!([
                ["dram-0", "127.0.0.1:5000", "dram", 1, 1],
                ["dram-1", "127.0.0.1:5001", "dram", 1, 0]
            ]),
        );
        let unknown = first.with_weight_map(&map).unwrap();
        assert!(unknown.earlier_homes(b"k").is_none());
        map.insert(
            "earlier".into(),
            serde_json::json!([{"servers": [["dram-0", 1, 1], ["gone", 5, 0]]}]),
        );
        let grown = first.with_weight_map(&map).unwrap();
        assert_eq!(first.earlier_homes(b"k"), Some(vec![]));
        for n in 0..40 {
            let key = format!("k{n}");
            // dram-0 (index 0) or the server no longer in the map, which is no rival.
            let homes = grown.earlier_homes(key.as_bytes()).unwrap();
            assert!(homes.is_empty() || homes == vec![0], "{key}: {homes:?}");
        }
        assert!((0..40).any(|n| grown.earlier_homes(format!("k{n}").as_bytes()).unwrap() == [0]));
        for bad in [
            serde_json::json!({"servers": []}),
            serde_json::json!([{"servers": [["a", -1, 0]]}]),
            serde_json::json!([{"servers": [["a", 1]]}]),
            serde_json::json!([{"pools": {}}]),
            serde_json::json!(vec![
                serde_json::json!({"servers": []});
                EARLIER_MAPS_MAX + 1
            ]),
        ] {
            map.insert("earlier".into(), bad.clone());
            assert!(first.with_weight_map(&map).is_err(), "{bad}");
        }
    }

    #[test]
    fn malformed_maps_are_refused() {
        for text in [
            "{}",
            r#"{"job":"j","epoch":1,"token":"t","block_size":0,"servers":[]}"#,
            r#"{"job":"j","epoch":1,"token":"t","block_size":1,"servers":[["a","noport","dram",1,0]]}"#,
            r#"{"job":"j","epoch":1,"token":"t","block_size":1,"servers":[["a","h:1","dram",-1,0]]}"#,
        ] {
            assert!(View::from_handle_json(text).is_err(), "{text}");
        }
        assert!(stale_weight_map("stale_epoch: not json").is_none());
        assert!(stale_weight_map("not_found: x").is_none());
    }
}
