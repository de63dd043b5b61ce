package main

// Unaggregated discovery ("GET /apis" without the apidiscovery Accept
// header, used by the Python client's dynamic client and older kubectl)
// lists only groups installed on the generic server. In kube-apiserver the
// aggregator adds the CRD groups; here a small CRD informer handler does.

import (
	"sort"

	apiextensionsv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
	extapiserver "k8s.io/apiextensions-apiserver/pkg/apiserver"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/version"
	"k8s.io/client-go/tools/cache"
)

func syncCRDGroupsIntoDiscovery(ext *extapiserver.CustomResourceDefinitions) {
	crds := ext.Informers.Apiextensions().V1().CustomResourceDefinitions()
	lister := crds.Lister()
	builtin := map[string]bool{"apiextensions.k8s.io": true}
	for _, g := range coreGroupVersions {
		builtin[g.Group] = true
	}
	resync := func(obj interface{}) {
		if t, ok := obj.(cache.DeletedFinalStateUnknown); ok {
			obj = t.Obj
		}
		crd, ok := obj.(*apiextensionsv1.CustomResourceDefinition)
		if !ok || builtin[crd.Spec.Group] {
			return
		}
		group := crd.Spec.Group
		all, err := lister.List(labels.Everything())
		if err != nil {
			return
		}
		seen := map[string]bool{}
		var versions []string
		for _, c := range all {
			if c.Spec.Group != group || c.DeletionTimestamp != nil {
				continue
			}
			for _, v := range c.Spec.Versions {
				if v.Served && !seen[v.Name] {
					seen[v.Name] = true
					versions = append(versions, v.Name)
				}
			}
		}
		if len(versions) == 0 {
			ext.GenericAPIServer.DiscoveryGroupManager.RemoveGroup(group)
			return
		}
		// Highest "kube-aware" version first (v1 > v1beta1 > v1alpha1).
		sort.Slice(versions, func(i, j int) bool {
			return version.CompareKubeAwareVersionStrings(versions[i], versions[j]) > 0
		})
		apiGroup := metav1.APIGroup{Name: group}
		for _, v := range versions {
			apiGroup.Versions = append(apiGroup.Versions, metav1.GroupVersionForDiscovery{GroupVersion: group + "/" + v, Version: v})
		}
		apiGroup.PreferredVersion = apiGroup.Versions[0]
		ext.GenericAPIServer.DiscoveryGroupManager.AddGroup(apiGroup)
	}
	_, _ = crds.Informer().AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    resync,
		UpdateFunc: func(_, obj interface{}) { resync(obj) },
		DeleteFunc: resync,
	})
}
