//! The listing floor: how long a plain client takes to page through the Services and
//! EndpointSlices the agent lists, with the agent's page size, selector and resourceVersion,
//! decoding them into k8s-openapi types and doing nothing else. The two kinds are paged at
//! once, each by a task of its own, as the agent lists them.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::{ListParams, ObjectList};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Api, Client, Resource};
use nftproxy::watch::{LIST_PAGE_SIZE, SERVICE_SELECTOR};
use serde::de::DeserializeOwned;

use crate::netns::Netns;

/// Pages through both kinds once; returns the time and the objects listed.
pub fn measure(ns: &Netns, kubeconfig: &Path) -> Result<(Duration, usize)> {
    ns.run_in(|| {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()?;
        rt.block_on(async {
            let kubeconfig = Kubeconfig::read_from(kubeconfig)?;
            let config =
                kube::Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
                    .await?;
            let client = Client::try_from(config)?;
            let start = Instant::now();
            let services = tokio::spawn(page_all::<Service>(client.clone()));
            let slices = tokio::spawn(page_all::<EndpointSlice>(client));
            let n = services.await?? + slices.await??;
            Ok((start.elapsed(), n))
        })
    })
}

async fn page_all<K>(client: Client) -> Result<usize>
where
    K: Resource<Scope = k8s_openapi::NamespaceResourceScope>
        + Clone
        + DeserializeOwned
        + std::fmt::Debug,
    K::DynamicType: Default,
{
    let api: Api<K> = Api::all(client);
    let mut params = ListParams::default()
        .labels(SERVICE_SELECTOR)
        .limit(LIST_PAGE_SIZE)
        .match_any();
    let mut n = 0;
    loop {
        let page: ObjectList<K> = api.list(&params).await.context("listing")?;
        n += page.items.len();
        match page.metadata.continue_.filter(|c| !c.is_empty()) {
            Some(token) => params.continue_token = Some(token),
            None => return Ok(n),
        }
    }
}
